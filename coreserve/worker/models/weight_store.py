"""A loaded model's weights as RL changes them (engine-core process, and each tensor-parallel rank):
new tensors in place, checked whole before any is copied (weight_update.py), and sleep level 2's drop
(each parameter's memory freed, its shape kept) and return. What a backend derived from the weights'
addresses is the runner's to rebuild after; a fresh allocation is handed to `renew_memory` first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from coreserve.worker.models.decoder import DecoderModel
from coreserve.worker.models.loader import load_weights
from coreserve.worker.models.sharding import Shard
from coreserve.worker.models.weight_update import check_weights, update_weights_from_path


class WeightStore:
    def __init__(self, model: DecoderModel, shard: Shard | None, check_tensors: bool = True) -> None:
        self.model = model
        self.shard = shard
        self.check_tensors = check_tensors  # NaN and infinities refused in new weights
        self.dropped: list[tuple[torch.nn.Parameter, torch.Size]] = []  # sleep level 2: the weights' shapes

    @property
    def is_dropped(self) -> bool:
        return bool(self.dropped)

    def check(self, path: str) -> int:
        """update's checks of every name and shape, nothing copied (a ValueError when one does not fit);
        returns how many tensors an update would change. After a drop the update must hold them all."""
        if not self.dropped:
            return check_weights(self.model, path, self.shard)
        if not path.endswith(".safetensors"):
            return 0  # a checkpoint folder or GGUF file: the loader's own checks, when it loads
        kept = {id(param): shape for param, shape in self.dropped}
        stand_ins = {
            name: torch.empty(kept[id(param)], device="meta")
            for name, param in self.model.named_parameters(remove_duplicate=False)
        }
        return check_weights(self.model, path, self.shard, stand_ins, is_whole=True)

    def update(self, path: str, renew_memory: Callable[[DecoderModel], None]) -> int:
        """Validates every tensor of `path` before copying any; returns how many it copied. After a drop
        the memory is allocated again (then `renew_memory`) and the update must hold every weight: a
        safetensors file (the frontend's tensors) is checked whole first; a folder or GGUF file goes
        through the loader, which needs every weight or raises a ValueError."""
        if not self.dropped:
            return update_weights_from_path(self.model, path, self.shard, self.check_tensors)
        is_file = path.endswith(".safetensors")
        if is_file:
            self.check(path)
        self._allocate(renew_memory)
        try:
            if is_file:
                update_weights_from_path(self.model, path, self.shard, self.check_tensors)
            else:
                load_weights(self.model, path, self.shard, self.check_tensors)
        except BaseException:
            self.drop()
            raise
        return sum(1 for _ in self.model.parameters())

    def drop(self) -> None:
        """Each parameter's memory freed (tied ones once), its shape kept."""
        seen = set()
        for param in self.model.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                self.dropped.append((param, param.shape))
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _allocate(self, renew_memory: Callable[[DecoderModel], None]) -> None:
        for param, shape in self.dropped:
            param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
        self.dropped = []
        renew_memory(self.model)
