"""A hybrid model's memory beside its KV cache (engine-core process): the recurrent state slots (one a
running request: no more requests run at once than there are slots) and, with prefix caching, the
snapshots of that state every few blocks of a cached chain (coreserve/engine_core/state_snapshots.py).
Sized here, once at start, from the model's state size, the KV block's size and EngineConfig; the worker
holds the slots (coreserve/worker/kv_memory.py).

What a hybrid does not do yet is refused here by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from coreserve.engine_core.state_snapshots import StateSnapshots
from coreserve.protocol.config import EngineConfig

logger = logging.getLogger(__name__)

STATE_SHARE = 0.5  # the state slots take at most this share of kv_cache_gib
SNAPSHOT_SHARE = 0.25  # the default snapshot spacing keeps snapshots within this share of the KV cache's bytes


@dataclass(frozen=True)
class HybridMemory:
    state_bytes_per_seq: int  # a request's recurrent state, every recurrent layer (0: not a hybrid)
    num_state_slots: int = 0
    snapshot_every_blocks: int = 0  # 0: no snapshots (not a hybrid, or prefix caching off)

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.state_bytes_per_seq

    def num_snapshot_slots(self, num_kv_blocks: int) -> int:
        """One a snapshot boundary of the whole KV cache."""
        return max(1, num_kv_blocks // self.snapshot_every_blocks) if self.snapshot_every_blocks else 0

    def snapshots(self, num_kv_blocks: int, block_size: int) -> StateSnapshots | None:
        if not self.snapshot_every_blocks:
            return None
        return StateSnapshots(self.num_snapshot_slots(num_kv_blocks), self.snapshot_every_blocks, block_size)


def hybrid_memory(config: EngineConfig, state_bytes_per_seq: int, bytes_per_block: int) -> HybridMemory:
    """The state slots (max_num_seqs of them, within STATE_SHARE of kv_cache_gib) and the snapshot spacing:
    state_snapshot_blocks, or the fewest blocks apart that keep snapshots within SNAPSHOT_SHARE of the
    KV cache's bytes. HybridMemory(0) for a model of attention layers only."""
    if not state_bytes_per_seq:
        return HybridMemory(0)
    for name, is_asked in (("speculative decoding", config.speculative_config is not None),
                           ("LoRA (enable_lora)", config.enable_lora)):
        if is_asked:
            raise ValueError(f"{name} with a hybrid model (recurrent layers) is not built yet")
    fit = int(config.kv_cache_gib * 2**30 * STATE_SHARE // state_bytes_per_seq)
    if fit < 1:
        raise ValueError(f"a request's recurrent state takes {state_bytes_per_seq / 2**30:.2f} GiB, more than "
                         f"{STATE_SHARE} of kv_cache_gib={config.kv_cache_gib}: raise kv_cache_gib (--kv-cache-gib)")
    slots = min(config.max_num_seqs, fit)
    if slots < config.max_num_seqs:
        logger.warning("max_num_seqs is %d, not %d: a request's recurrent state takes %.1f MiB, and the state "
                       "slots are held to %s of kv_cache_gib=%s", slots, config.max_num_seqs,
                       state_bytes_per_seq / 2**20, STATE_SHARE, config.kv_cache_gib)
    every = 0
    if config.enable_prefix_caching:
        every = config.state_snapshot_blocks or -(-state_bytes_per_seq // int(bytes_per_block * SNAPSHOT_SHARE))
    return HybridMemory(state_bytes_per_seq, slots, every)
