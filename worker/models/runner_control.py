"""What RL asks of a running model, beside its steps: new weights in place, and sleep (engine-core
process, and each tensor-parallel rank process, on that rank's runner).

Sleep level 1 frees the KV cache (the core's block pool restarts empty on wake); level 2 drops the
weights too, keeping only their shapes: a wake with a checkpoint, or an update holding every weight,
brings them back. Whatever the backend derived from the weights' addresses (the fused decode
forward's descriptors, the huge-page mapping) is built again when the memory is new.
"""

from __future__ import annotations

import logging
import time

import torch

from worker.cpu.fused_decode import FusedForward
from worker.cpu.huge_pages import move_linear_weights_to_huge_pages
from worker.models.loader import _load_weights as load_checkpoint_into
from worker.models.weight_update import check_weights, update_weights_from_path
from worker.parallel.sharding import Shard

logger = logging.getLogger(__name__)


class RunnerControl:
    """Beside a ModelRunner (it reads and sets the runner's model, KV caches and fused forward)."""

    def __init__(self, runner) -> None:  # worker.model_runner.ModelRunner
        self.runner = runner
        group = runner.group
        self.shard = None if group is None else Shard(group.rank, group.size)
        self.num_kv_blocks = 0  # what the KV cache held when it was freed
        self.dropped: list[tuple[torch.nn.Parameter, torch.Size]] = []  # sleep level 2: the weights' shapes
        self.last_timings: dict[str, float] = {}  # the last update's phases, seconds

    def check_weights(self, path: str) -> int:
        """update_weights' checks of every name and shape, nothing copied (a ValueError when one does
        not fit): what the tensor-parallel ranks and several cores all pass before any of them writes."""
        if not self.dropped:
            return check_weights(self.runner.model, path, self.shard)
        if not path.endswith(".safetensors"):
            return 0  # a checkpoint folder or GGUF file: the loader's own checks, when it loads
        kept = {id(param): shape for param, shape in self.dropped}
        stand_ins = {name: torch.empty(kept[id(param)], device="meta")
                     for name, param in self.runner.model.named_parameters(remove_duplicate=False)}  # fmt: skip
        return check_weights(self.runner.model, path, self.shard, stand_ins, is_whole=True)

    def update_weights(self, path: str) -> int:
        """Validates every tensor of `path` before copying any; returns how many it copied. After
        sleep level 2 the memory is allocated again and the update must hold every weight.
        `last_timings`: the load (checks and copies) and derive phases, seconds."""
        begun = time.perf_counter()
        self.runner.last_step_at = time.monotonic()  # the huge-page collapse waits, as on a step
        if self.dropped:
            # A safetensors file (the frontend's tensors) is checked whole first; a folder or GGUF file
            # goes through the loader, which needs every weight or raises a ValueError.
            is_file = path.endswith(".safetensors")
            if is_file:
                self.check_weights(path)
            self._allocate_weights()
            try:
                if is_file:
                    update_weights_from_path(self.runner.model, path, self.shard)
                else:
                    load_checkpoint_into(self.runner.model, path, self.shard)
            except BaseException:
                self.drop_weights()
                raise
            count = sum(1 for _ in self.runner.model.parameters())
        else:
            count = update_weights_from_path(self.runner.model, path, self.shard)
        loaded = time.perf_counter()
        self._rederive()
        self.last_timings = {"load": loaded - begun, "derive": time.perf_counter() - loaded}
        logger.info("update_weights: %d tensors in %.3f s", count, time.perf_counter() - begun)
        self.runner.last_step_at = time.monotonic()
        return count

    def sleep(self, level: int) -> None:
        runner = self.runner
        if runner.kv_caches:
            self.num_kv_blocks = runner.kv_caches[0].shape[2] // runner.block_size
        runner.fused = None
        runner.kv_caches = []
        if level >= 2 and not self.dropped:
            self.drop_weights()

    def wake_up(self, wake_kv_cache: bool, path: str | None) -> None:
        """`path`: the checkpoint the dropped weights come back from (required after level 2)."""
        if path is not None:
            self.update_weights(path)
        elif self.dropped:
            raise ValueError("the weights were dropped (sleep level 2): wake up with a checkpoint path, "
                             "or call update_weights with the whole state")  # fmt: skip
        if wake_kv_cache and not self.runner.kv_caches and self.num_kv_blocks:
            self.runner.allocate_kv_cache(self.num_kv_blocks)  # zeroed; builds the fused forward again

    @property
    def has_weights(self) -> bool:
        return not self.dropped

    def drop_weights(self) -> None:
        """Each parameter's memory freed (tied ones once), its shape kept."""
        seen = set()
        for param in self.runner.model.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                self.dropped.append((param, param.shape))
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _allocate_weights(self) -> None:
        for param, shape in self.dropped:
            param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
        self.dropped = []
        if self.runner.cpu_kernels is not None:
            move_linear_weights_to_huge_pages(self.runner.model)  # fresh memory: rewritten next

    def _rederive(self) -> None:
        """The fused forward's descriptors read the weights' addresses: built again over the same caches."""
        runner = self.runner
        if runner.can_fuse_decode and runner.kv_caches:
            runner.fused = FusedForward(runner.cpu_kernels, runner.model.weights(), runner.kv_caches,
                                        runner.model.args)  # fmt: skip


def executor_control(executor):
    """The control of an Executor: the tensor-parallel one drives its ranks' RunnerControls itself;
    the in-process ModelRunner gets one beside it."""
    return executor if hasattr(executor, "wake_up") else RunnerControl(executor)
