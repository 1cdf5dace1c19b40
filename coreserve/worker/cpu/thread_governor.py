"""How many threads a step takes while the host is shared (engine-core process).

The kernels' threads wait for each other at every barrier of a step (a product's end, the fused
forward's stages) by spinning, which is what makes a step fast when the engine has the cores to itself.
When another busy process shares those cores (a second engine, a trainer beside its engine), the
thread a barrier waits for is often not running, and its partner spins away the time slice the other
process needed: two engines on two cores each ran at 0.25x of their speed alone (SmolLM2, Intel host;
0.06x on an AMD host), and a passive wait for all (`OMP_WAIT_POLICY=passive`) cost a lone engine 45%.

So the count follows the host, measured every `period_s` from the kernel's own accounts:
- the step's thread (this process's main thread, which takes part in every parallel region) waited
  for a CPU more than `CONTENDED` of the time (its run queue delay in /proc/self/task/<tid>/schedstat):
  the host is shared, the steps go on as many threads as the cores this process got (its CPU time in
  /proc/self/stat) and those left idle, rounded, at least one: one on two cores beside another busy
  process (no barrier to wait at, one core's worth of work), eight each for two engines of sixteen
  threads on sixteen cores, which one thread each would leave at a sixteenth of their speed;
- fewer threads than it may take, and the CPUs this process may use (its affinity's lines of /proc/stat)
  left `FREE` of each further core idle, twice in a row: back to all of them; short of that, one more
  thread for each core left at least `FREE` idle, twice in a row (three engines sharing sixteen cores,
  one of them stopped: the other two grow into the cores it left, and back to eight each if they
  then wait for a CPU).
An engine alone never meets the first (its threads have the cores), so it keeps its speed; where
/proc is not there (not Linux), or with CORESERVE_FIXED_THREADS=1 in the environment, the count never
changes. In a process that is not the engine's own (`guest`: LLM(multiprocess=False) runs in the user's
process, whose torch settings an engine must not change) the user's thread count is the most a step
takes, a step that takes fewer sets them for itself alone (`step()`), and the user's count is back
when the step ends. Every kernel gives the same bits at any thread
count (tests/test_quant_kernels.py, test_cpu_kernels.py), so the numbers do not follow the host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import torch

CONTENDED = 0.2  # share of the time the step's thread waited for a CPU: the host is shared
FREE = 0.75  # share of a core left idle, for each core a step could take back

logger = logging.getLogger(__name__)


class ThreadGovernor:
    def __init__(self, max_threads: int, period_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic, set_threads: Callable[[int], None] = torch.set_num_threads,
                 proc: str = "/proc", guest: bool = False) -> None:
        self.max_threads, self.period_s, self.clock, self.set_threads = max_threads, period_s, clock, set_threads
        self.guest = guest
        if guest:  # the count is set around each step (`step`), never left changed
            self.set_threads = lambda threads: None
        self.proc = proc
        self._step_thread = os.getpid()  # the thread that steps (its schedstat is read); set at its first step
        self._cpus = {f"cpu{n}" for n in _allowed_cpus()}  # the CPUs this process may run on
        self.threads = max_threads
        self.changes = 0  # how often the count moved (for the logs and the tests)
        self._free_looks = 0  # looks in a row that found the cores free (two take the threads back)
        self._fixed = os.environ.get("CORESERVE_FIXED_THREADS", "0") not in ("", "0")
        self._last = None if self._fixed else self.sample()

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """The `with` block of one step, given its thread count. In the engine's own process the count
        is set when it changes and stays set; as a guest the host's current count is the most, a step
        that takes fewer sets torch's count for itself, and the host's is restored when it ends."""
        if not self.guest:
            yield self.before_step()
            return
        host = torch.get_num_threads()
        self.max_threads, self.threads = host, min(self.threads, host)
        threads = self.before_step()
        if threads == host:
            yield threads
            return
        torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            torch.set_num_threads(host)

    def before_step(self) -> int:
        """The threads this step takes (after a fresh look at the host where `period_s` has passed)."""
        if self.max_threads <= 1 or self._last is None or self.clock() - self._last[0] < self.period_s:
            return self.threads
        step_thread = threading.get_native_id()
        if step_thread != self._step_thread:  # steps run on another thread than the one that built this
            self._step_thread, self._last = step_thread, self.sample()
            return self.threads
        sample = self.sample()
        if sample is None:
            return self.threads
        wall = sample[0] - self._last[0]
        waited = (sample[1] - self._last[1]) / wall  # seconds the step's thread waited, per second
        idle_cores = (sample[2] - self._last[2]) / wall
        got = (sample[3] - self._last[3]) / wall + idle_cores  # cores this process had, or could have had
        self._last = sample
        if self.threads > 1 and waited > CONTENDED:
            self._set(max(1, min(self.threads - 1, round(got))))
        elif self.threads < self.max_threads:
            spare = int(min(idle_cores, self.max_threads) + 1 - FREE)  # cores left at least FREE idle
            is_free = min(idle_cores, self.max_threads) > FREE * (self.max_threads - self.threads)
            self._free_looks = self._free_looks + 1 if is_free or spare >= 1 else 0
            if self._free_looks >= 2:  # twice in a row: a pause between the other's steps is not its end
                self._free_looks = 0
                self._set(self.max_threads if is_free else min(self.max_threads, self.threads + spare))
        return self.threads

    def _set(self, threads: int) -> None:
        logger.info("steps take %d of %d threads (%s)", threads, self.max_threads,
                    "another busy process shares the cores" if threads < self.max_threads else "the cores are free")
        self.threads = threads
        self.changes += 1
        self.set_threads(threads)

    def sample(self) -> tuple[float, float, float, float] | None:
        """(now, the main thread's run-queue wait in seconds, idle CPU seconds of the host, this process's
        CPU seconds), or None."""
        try:
            ticks = os.sysconf("SC_CLK_TCK")
            with open(f"{self.proc}/self/task/{self._step_thread}/schedstat") as f:
                waited_ns = int(f.read().split()[1])
            with open(f"{self.proc}/self/stat") as f:  # "pid (comm) state ... utime stime ..." (fields 14, 15)
                fields = f.read().rsplit(")", 1)[1].split()
                cpu_ticks = int(fields[11]) + int(fields[12])
            idle_ticks = 0
            with open(f"{self.proc}/stat") as f:
                for line in f:  # "cpuN user nice system idle iowait ..." in clock ticks, the allowed CPUs'
                    fields = line.split()
                    if fields and fields[0] in self._cpus:
                        idle_ticks += int(fields[4]) + int(fields[5])
        except (OSError, ValueError, IndexError, AttributeError):  # not Linux: no /proc, no sysconf
            return None
        return self.clock(), waited_ns / 1e9, idle_ticks / ticks, cpu_ticks / ticks


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))
