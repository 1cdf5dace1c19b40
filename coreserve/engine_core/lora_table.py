"""The core's LoRA adapters (engine-core process): which adapter each request runs with, loaded once per
load into a slot of the runner (coreserve/worker/lora/slots.py), and when a slot is dropped.

A slot is one load of one adapter: its int_id and name, its path, and a generation that a load in place
(`load(..., inplace=True)`, vLLM's load_inplace, what RL syncs use) moves on. Every read goes to the runner
as the `add_lora` control verb (`Executor.collective_rpc`: a RankCall to every rank, each keeping its
shard) and runs between steps, never inside `schedule()`: a control command's load at once, a request's
adapter when the core drains the reads the scheduler asked for (`load_wanted`, before each schedule).
A request's adapter is checked when it arrives (`check`); the scheduler admits it only once its adapter
is resident (`is_ready` asks for the read otherwise, and the request waits, keeping its turn; a read that
fails fails the requests waiting for it, `load_wanted`'s failures). Reads count with the adapters
running against max_loras, so none is read that could not join, and a load read for waiting requests is
kept (not idle, never trimmed) until one is admitted or none waits (`add_waiter`, `remove_waiter`).
At admission (`admit`) it takes the slot of its adapter's current load and keeps it to its end, so it
never mixes two versions; the prefix cache keys a LoRA request's blocks by its slot (Request.cache_root),
so no request reads KV computed under another adapter or another load of its own. A slot no request
holds is dropped when the adapter was loaded again, unloaded, or when more than max_cpu_loras idle slots
are kept (least recently used first). Where `allowed_roots` is set, every load's path must lie under one
of them, resolved in this process with symlinks followed (`allowed_path`): the runner reads that folder.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coreserve.protocol.sampling_params import LoraRef

if TYPE_CHECKING:  # the type only: torch comes with the executor, which core.py builds
    from coreserve.worker.executor import Executor

logger = logging.getLogger(__name__)

CORE_IDS = 2**30  # lora_int_ids from here on are the core's own, for adapters loaded by name


@dataclass
class Slot:
    slot: int
    name: str
    int_id: int
    path: str
    generation: int


class LoraTable:
    def __init__(self, executor: Executor, enabled: bool, max_loras: int = 1, max_cpu_loras: int | None = None,
                 allowed_roots: tuple[str, ...] | None = None) -> None:
        self.executor = executor  # its collective_rpc runs the runner's add_lora and remove_lora verbs
        self.enabled = enabled
        self.max_loras = max_loras  # adapters in one step
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras  # idle loads kept
        self.allowed_roots = allowed_roots  # folders every adapter path lies under (None: any)
        self._known: dict[int, tuple[str, str, int]] = {}  # int_id -> (name, path, generation) of its latest load
        self._by_name: dict[str, int] = {}  # name -> int_id
        self._current: dict[int, Slot] = {}  # int_id -> its latest load, while loaded
        self._slots: dict[int, Slot] = {}  # every slot loaded in the runner
        self._idle: OrderedDict[int, None] = OrderedDict()  # current slots no request holds, LRU first
        self._holders: dict[int, int] = {}  # slot -> requests holding it
        self._wanted: dict[int, LoraRef] = {}  # int_id -> a waiting request's adapter to read before the next step
        self._reserved: set[int] = set()  # slots read for waiting requests, none admitted yet: kept, not idle
        self._num_waiting: dict[int, int] = {}  # int_id -> requests waiting for it (not admitted)
        self._slot_ids = itertools.count()
        self._int_ids = itertools.count(CORE_IDS)  # ids of adapters loaded by name alone (the server's)
        self.on_drop: Callable[[int], None] = lambda slot: None  # a load gone: its KV can never be read again

    def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of every adapter known (loaded now, or again at its next request)."""
        return sorted((name, path) for name, path, _ in self._known.values())

    def adapter_of(self, slot: int) -> tuple[int, str]:
        """The (int id, name) of the adapter loaded in `slot` (a KV event's lora_id and lora_name)."""
        loaded = self._slots[slot]
        return loaded.int_id, loaded.name

    def check(self, ref: LoraRef) -> None:
        """A request's adapter, as it arrives and again as it is admitted (nothing is read here); a
        ValueError names what is wrong: LoRA off, a name or an id another adapter has, or an id of the
        core's own range (adapters loaded by name) that is not loaded (unloaded since)."""
        if not self.enabled:
            raise ValueError("lora_request: LoRA is off in this engine (start it with enable_lora=True, "
                             "--enable-lora)")
        owner = self._by_name.get(ref.name)
        if owner is not None and owner != ref.int_id:
            raise ValueError(f"lora_request: the name {ref.name!r} belongs to lora_int_id {owner}, not {ref.int_id}")
        known = self._known.get(ref.int_id)
        if known is not None and known[0] != ref.name:
            raise ValueError(f"lora_request: lora_int_id {ref.int_id} belongs to the adapter {known[0]!r}, "
                             f"not {ref.name!r}")
        if known is None and ref.int_id >= CORE_IDS:
            raise ValueError(f"lora_request: no LoRA adapter {ref.name!r} is loaded (it was unloaded)")

    def has_room(self, req, running: list) -> bool:
        """Whether `req` (a Request) may join the `running` requests: at most max_loras adapters a step."""
        lora = req.params.lora
        if lora is None:
            return True
        adapters = {r.params.lora.int_id for r in running if r.params.lora is not None}
        return lora.int_id in adapters or len(adapters) < self.max_loras

    def add_waiter(self, ref: LoraRef) -> None:
        """A request naming `ref` arrived: it waits for its adapter until `admit` or `remove_waiter`."""
        self._num_waiting[ref.int_id] = self._num_waiting.get(ref.int_id, 0) + 1

    def remove_waiter(self, ref: LoraRef) -> None:
        """A request waiting for `ref` was admitted or left (aborted, failed); after the last, a load read
        for them and still unheld becomes idle (trimmed past max_cpu_loras)."""
        num_left = self._num_waiting.pop(ref.int_id, 0) - 1
        if num_left > 0:
            self._num_waiting[ref.int_id] = num_left
            return
        current = self._current.get(ref.int_id)
        if current is not None and current.slot in self._reserved:
            self._reserved.discard(current.slot)
            self._idle[current.slot] = None
            self._trim()

    def is_ready(self, req, running: list) -> bool:
        """Whether `req` (a Request the scheduler would admit now beside `running`) has its adapter
        resident, or needs none, or fails its check (`admit` then says why). Else the request waits, and
        its read is asked for where `_joining` leaves room in max_loras (`load_wanted` reads it)."""
        ref = req.params.lora
        if ref is None or req.lora_slot >= 0 or ref.int_id in self._current:
            return True
        try:
            self.check(ref)
        except ValueError:
            return True
        if ref.int_id in self._wanted or len(self._joining(running)) < self.max_loras:
            self._wanted[ref.int_id] = ref
        return False

    def _joining(self, running: list) -> set[int]:
        """The adapters of the next steps: running, asked for, or read for requests not admitted yet."""
        adapters = {r.params.lora.int_id for r in running if r.params.lora is not None}
        adapters.update(self._wanted)
        adapters.update(self._slots[slot].int_id for slot in self._reserved)
        return adapters

    def load_wanted(self) -> list[tuple[int, str]]:
        """Reads the adapters waiting requests asked for (between steps: the core's, before `schedule`);
        returns (lora_int_id, why) for each read that failed, whose waiting requests fail with it."""
        failed = []
        wanted, self._wanted = self._wanted, {}
        for int_id, ref in wanted.items():
            if int_id in self._current or not self._num_waiting.get(int_id):
                continue  # resident since, or its requests left (aborted): nothing to read
            name, path, generation = self._known.get(int_id, (ref.name, ref.path, 0))  # known: its latest load
            try:
                self.check(ref)
                self._load(name, int_id, path, generation, is_reserved=True)
            except ValueError as exc:
                failed.append((int_id, str(exc)))
        return failed

    def admit(self, req) -> str | None:
        """Gives `req` (a Request being admitted, `is_ready`) its adapter's slot where it names one and
        holds none yet; the error that fails it, or None."""
        if req.params.lora is None or req.lora_slot >= 0:
            return None
        try:
            self.check(req.params.lora)
        except ValueError as exc:
            return str(exc)
        req.lora_slot = self._hold_current(req.params.lora.int_id)
        self.remove_waiter(req.params.lora)
        return None

    def load(self, name: str, path: str, inplace: bool = False, int_id: int | None = None) -> Slot:
        """vLLM's /v1/load_lora_adapter: a new adapter under `name` (with `int_id`, the id its requests
        name; None: one of the core's), or (inplace) a new load of it, which the requests arriving from
        now on take (those running keep theirs)."""
        if not self.enabled:
            raise ValueError("LoRA is off in this engine (start it with enable_lora=True, --enable-lora)")
        known = self._by_name.get(name)
        if known is not None and not inplace:
            raise ValueError(f"a LoRA adapter named {name!r} is loaded already (load_inplace replaces it)")
        if known is not None and int_id is not None and int_id != known:
            raise ValueError(f"the LoRA adapter {name!r} has lora_int_id {known}, not {int_id}")
        if known is None and int_id is not None and int_id in self._known:
            raise ValueError(f"lora_int_id {int_id} belongs to the adapter {self._known[int_id][0]!r}")
        if int_id is None and known is None:
            int_id = next(self._int_ids)
            while int_id in self._known:  # a request's own id may lie in the core's range
                int_id = next(self._int_ids)
        int_id = known if known is not None else int_id
        generation = self._known[int_id][2] + 1 if int_id in self._known else 0
        slot = self._load(name, int_id, path, generation)
        self._trim()
        return slot

    def unload(self, name: str) -> None:
        int_id = self._by_name.pop(name, None)
        if int_id is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        del self._known[int_id]
        current = self._current.pop(int_id, None)
        if current is not None:
            self._retire(current)

    def release(self, slot: int) -> None:
        """A request that held `slot` ended."""
        self._holders[slot] -= 1
        if self._holders[slot]:
            return
        del self._holders[slot]
        held = self._slots[slot]
        if self._current.get(held.int_id) is not held:
            self._drop(slot)  # a load replaced or unloaded: no request takes it again
            return
        self._idle[slot] = None
        self._trim()

    def _hold_current(self, int_id: int) -> int:
        current = self._current[int_id]  # resident: is_ready held the request back until it was read
        self._holders[current.slot] = self._holders.get(current.slot, 0) + 1
        self._idle.pop(current.slot, None)
        self._reserved.discard(current.slot)  # held now: a request's end makes it idle
        return current.slot

    def _load(self, name: str, int_id: int, path: str, generation: int, is_reserved: bool = False) -> Slot:
        """The adapter read into a new slot on every rank, idle, or kept for waiting requests (`is_reserved`,
        or the load it replaces was); a ValueError leaves all as it was (a rank that read it drops it)."""
        read_path = allowed_path(path, self.allowed_roots)
        slot = Slot(next(self._slot_ids), name, int_id, path, generation)
        try:
            sizes = self.executor.collective_rpc("add_lora", {"slot": slot.slot, "name": name, "path": read_path})
        except ValueError:
            self.executor.collective_rpc("remove_lora", {"slot": slot.slot})
            raise
        logger.info("LoRA adapter %r (lora_int_id %d, load %d) read from %s: %.1f MiB", name, int_id, generation,
                    path, sum(sizes) / 2**20)
        previous = self._current.get(int_id)
        is_reserved = is_reserved or (previous is not None and previous.slot in self._reserved)
        self._slots[slot.slot], self._current[int_id] = slot, slot
        self._known[int_id], self._by_name[name] = (name, path, generation), int_id
        if previous is not None:
            self._retire(previous)
        if is_reserved:
            self._reserved.add(slot.slot)
        else:
            self._idle[slot.slot] = None
        return slot

    def _trim(self) -> None:
        """Past max_cpu_loras idle loads, the least recently used go (their adapters stay known)."""
        while len(self._idle) > self.max_cpu_loras:
            oldest, _ = self._idle.popitem(last=False)
            del self._current[self._slots[oldest].int_id]
            self._drop(oldest)

    def _retire(self, slot: Slot) -> None:
        """No new request takes `slot`; it goes when the last request holding it does."""
        self._idle.pop(slot.slot, None)
        self._reserved.discard(slot.slot)
        if slot.slot not in self._holders:
            self._drop(slot.slot)

    def _drop(self, slot: int) -> None:
        self._idle.pop(slot, None)
        del self._slots[slot]
        self.executor.collective_rpc("remove_lora", {"slot": slot})
        self.on_drop(slot)


def allowed_path(path: str, roots: tuple[str, ...] | None) -> str:
    """The adapter folder the runner reads: `path` as given where `roots` is None; else `path` resolved
    (symlinks followed) where it, and every entry directly in it (adapter_config.json and
    adapter_model.safetensors may be links), lie under one of `roots` (resolved too); a ValueError naming
    `path` where they do not. Checked before the path's existence, so a refusal says nothing of what lies
    outside the roots."""
    if roots is None:
        return path
    try:
        bases = [Path(root).resolve() for root in roots]
        folder = Path(path).resolve()
        inside = any(folder.is_relative_to(base) for base in bases)
        for entry in _entries(folder) if inside else []:
            inside = inside and any(entry.resolve().is_relative_to(base) for base in bases)
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        inside = False
    if not inside:
        raise ValueError(f"lora_path {path!r} is not under the allowed LoRA roots (lora_allowed_roots, "
                         "--lora-allowed-roots)")
    return str(folder)


def _entries(folder: Path) -> list[Path]:
    """What is directly in `folder`; nothing where it is not a readable folder (the reader says why)."""
    try:
        return list(folder.iterdir())
    except OSError:
        return []
