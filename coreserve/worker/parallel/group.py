"""One rank's membership of a tensor-parallel group: torch.distributed over gloo on the CPU, NCCL on
CUDA (a tensor-parallel worker process; coreserve/worker/parallel/rank.py).

The group meets through a FileStore in the folder the core made for its workers: no port to pick,
nothing listening on the network.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# A collective that waits longer than this on a rank raises rather than hanging the engine.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


class TensorParallelGroup:
    def __init__(self, rank: int, size: int, store_path: str, device: str) -> None:
        self.rank, self.size = rank, size
        is_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        self.device = (
            torch.device("cuda", rank) if is_cuda else torch.device(device if device != "auto" else "cpu")
        )
        if is_cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            "nccl" if is_cuda else "gloo",
            store=dist.FileStore(store_path, size),
            rank=rank,
            world_size=size,
            timeout=COLLECTIVE_TIMEOUT,
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        dist.all_reduce(tensor)
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrites `tensor` with rank 0's, in place; returns it."""
        dist.broadcast(tensor, src=0)
        return tensor

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
