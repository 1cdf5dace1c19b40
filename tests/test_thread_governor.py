"""The step's thread count on a shared host (coreserve/worker/cpu/thread_governor.py): one thread while the
step's thread waits for a CPU, all of them again once the host leaves the cores idle; the /proc
figures it reads are this host's real ones where it runs, and a hand-written /proc in the logic tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from coreserve.worker.cpu.thread_governor import ThreadGovernor


class FakeHost:
    """A /proc folder with the two files the governor reads, and a clock, moved by hand."""

    def __init__(self, root: Path) -> None:
        self.root, self.now, self.waited_ns, self.idle_ticks, self.cpu_ticks = root, 100.0, 0, 0, 0
        (root / "self" / "task" / str(os.getpid())).mkdir(parents=True)
        self.write()

    def write(self) -> None:
        (self.root / "self" / "task" / str(os.getpid()) / "schedstat").write_text(f"123 {self.waited_ns} 7\n")
        (self.root / "self" / "stat").write_text(f"{os.getpid()} (python3 (x)) R 1 2 3 4 5 6 7 8 9 10 "
                                                 f"{self.cpu_ticks} 0 0 0 20 0 1 0\n")
        cpus = sorted(os.sched_getaffinity(0))
        lines = [f"cpu{n} 10 0 5 {self.idle_ticks // len(cpus)} 0 0 0 0 0 0" for n in cpus]
        other = f"cpu{max(cpus) + 1} 10 0 5 {10**9 + self.idle_ticks} 0 0 0 0 0 0"  # a CPU not ours: ignored
        (self.root / "stat").write_text("\n".join([f"cpu  10 0 5 {10**9} 0 0 0 0 0 0", *lines, other]) + "\n")

    def advance(self, seconds: float, waited_s: float, idle_cores: float, used_cores: float = 0.0) -> None:
        self.now += seconds
        self.waited_ns += int(waited_s * 1e9)
        self.idle_ticks += int(idle_cores * seconds * os.sysconf("SC_CLK_TCK"))
        self.cpu_ticks += int(used_cores * seconds * os.sysconf("SC_CLK_TCK"))
        self.write()


def test_a_shared_host_takes_one_thread_and_a_free_one_takes_them_all_back(tmp_path):
    host, set_to = FakeHost(tmp_path), []
    governor = ThreadGovernor(2, period_s=0.25, clock=lambda: host.now, set_threads=set_to.append,
                              proc=str(tmp_path))
    host.advance(0.5, waited_s=0.01, idle_cores=0.0)  # alone: the step's thread waited 2% of the time
    assert governor.before_step() == 2 and set_to == []
    host.advance(0.5, waited_s=0.25, idle_cores=0.0)  # another busy process: it waited half the time
    assert governor.before_step() == 1 and set_to == [1]
    host.advance(0.1, waited_s=0.0, idle_cores=1.0)  # within the period: no new look
    assert governor.before_step() == 1
    host.advance(0.5, waited_s=0.0, idle_cores=0.2)  # both engines on one thread: no core idle
    assert governor.before_step() == 1 and set_to == [1]
    host.advance(0.5, waited_s=0.0, idle_cores=0.95)  # the other one paused or stopped: a core idle
    assert governor.before_step() == 1  # once is a pause between its steps
    host.advance(0.5, waited_s=0.0, idle_cores=0.95)  # twice in a row: it stopped
    assert governor.before_step() == 2 and set_to == [1, 2] and governor.changes == 2


def test_on_many_cores_a_shared_host_takes_the_cores_it_gets_not_one(tmp_path):
    """Two engines of 16 threads on 16 cores: each gets about 8 cores' time while they contend, so each
    steps on 8 threads (one would leave it a sixteenth of its speed); a busy loop beside one engine of 16
    leaves it 15. When the cores are free again, all of them come back; short of that, one more thread
    for each core left idle."""
    host, set_to = FakeHost(tmp_path), []
    governor = ThreadGovernor(16, period_s=0.25, clock=lambda: host.now, set_threads=set_to.append,
                              proc=str(tmp_path))
    host.advance(0.5, waited_s=0.2, idle_cores=0.0, used_cores=8.1)  # the other engine takes half
    assert governor.before_step() == 8 and set_to == [8]
    host.advance(0.5, waited_s=0.01, idle_cores=0.1, used_cores=8.0)  # 8 + 8: no one waits, nothing idle
    assert governor.before_step() == 8
    host.advance(0.5, waited_s=0.0, idle_cores=7.5, used_cores=8.0)  # the other one stopped
    assert governor.before_step() == 8  # once may be a pause
    host.advance(0.5, waited_s=0.0, idle_cores=7.5, used_cores=8.0)
    assert governor.before_step() == 16 and set_to == [8, 16]
    host.advance(0.5, waited_s=0.15, idle_cores=0.0, used_cores=14.8)  # a busy loop beside it
    assert governor.before_step() == 15
    host.advance(0.5, waited_s=0.3, idle_cores=0.0, used_cores=5.3)  # three engines share the cores
    assert governor.before_step() == 5
    host.advance(0.5, waited_s=0.0, idle_cores=5.9, used_cores=5.0)  # one stopped: about 6 cores idle
    assert governor.before_step() == 5
    host.advance(0.5, waited_s=0.0, idle_cores=5.9, used_cores=5.0)  # twice: it grows into them
    assert governor.before_step() == 11
    host.advance(0.5, waited_s=0.25, idle_cores=0.0, used_cores=8.0)  # the other grew too: 8 each
    assert governor.before_step() == 8
    host.advance(0.5, waited_s=0.0, idle_cores=0.6, used_cores=8.0)  # less than FREE of a core idle
    host.advance(0.5, waited_s=0.0, idle_cores=0.6, used_cores=8.0)
    assert governor.before_step() == 8


def test_without_proc_or_when_fixed_the_count_stays(tmp_path, monkeypatch):
    set_to = []
    governor = ThreadGovernor(2, clock=lambda: 1e9, set_threads=set_to.append, proc=str(tmp_path / "none"))
    assert governor.before_step() == 2 and set_to == []
    host = FakeHost(tmp_path)
    monkeypatch.setenv("CORESERVE_FIXED_THREADS", "1")
    fixed = ThreadGovernor(2, clock=lambda: host.now, set_threads=set_to.append, proc=str(tmp_path))
    host.advance(1.0, waited_s=0.9, idle_cores=0.0)
    assert fixed.before_step() == 2 and set_to == []


def test_this_hosts_proc_figures_are_read():
    """On Linux the real files parse: the sample is (now, seconds waited, idle CPU seconds)."""
    governor = ThreadGovernor(max(2, torch.get_num_threads()), set_threads=lambda n: None)
    sample = governor.sample()
    assert sample is not None
    now, waited_s, idle_s, cpu_s = sample
    assert waited_s >= 0 and idle_s > 0 and now > 0 and cpu_s > 0


def test_a_guest_step_takes_fewer_threads_and_gives_the_hosts_count_back(tmp_path):
    """In a user's process the governor sets torch's count for one step alone: one thread while the
    host is shared, the user's count again when the step ends; the user's count is the most it takes."""
    host, before = FakeHost(tmp_path), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        governor = ThreadGovernor(2, period_s=0.25, clock=lambda: host.now, proc=str(tmp_path), guest=True)
        host.advance(0.5, waited_s=0.25, idle_cores=0.0)  # shared
        with governor.step() as threads:
            assert threads == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)  # the user asks for one: a step never takes more
        host.advance(0.5, waited_s=0.0, idle_cores=1.0)
        host.advance(0.5, waited_s=0.0, idle_cores=1.0)
        with governor.step() as threads:
            assert threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_an_in_process_engine_never_changes_its_hosts_threads(tiny_path):
    """LLM(multiprocess=False) runs in the user's process: on a busy host (two processes spinning on the
    cores) its steps take one thread, but torch's count between them is the user's, as it was before."""
    import subprocess
    import sys

    from coreserve import LLM, SamplingParams

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    spin = "import time\nend = time.time() + 20\nwhile time.time() < end: pass"
    burners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        with LLM(tiny_path, multiprocess=False) as llm:
            governor = llm.engine.client.core.executor.backend.threads
            params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
            for _ in range(3):  # steps for longer than the governor's period, on a host it sees as shared
                llm.generate(["one two three"] * 4, params, use_tqdm=False)
                assert torch.get_num_threads() == 2
            assert governor.changes >= 1  # it saw the host shared: its steps took one thread
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        torch.set_num_threads(before)
