"""The parent's handle on the untrusted-input fuzzer's child process (tests/untrusted_fuzz_child.py): one
spawned process runs case after case; while it works the parent watches its clock and its resident memory,
and kills it past the time limit ("hang") or the memory limit ("memory"); a child that dies or is killed is
started again, and prepared again, for the next case.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass, field
from pathlib import Path

from untrusted_fuzz_child import child_main
from untrusted_mutation import Bases

POLL_S = 0.05
PREPARE_TIME_S = 600.0  # the first run makes the bases (a GGUF, a PEFT adapter) and imports everything


@dataclass
class Reply:
    """How a call ended: "done" (`result` holds the child's answer), "hang", "memory" (killed), or "died"."""

    ending: str
    result: dict | Bases | None = None
    step: str = ""  # the step the child had begun when it ended
    growth_kib: int = 0  # the largest resident growth the parent saw
    seconds: float = 0.0
    exit_code: int | None = None
    steps_begun: list[str] = field(default_factory=list)


class Child:
    def __init__(self, cache_dir: Path, log_path: Path) -> None:
        self.cache_dir, self.log_path = cache_dir, log_path
        self.process = None
        self.conn = None
        self.bases: Bases | None = None
        self.summarised: set[str] = set()  # the hybrid bases this child has loaded for comparison
        self.num_starts = 0  # 1 + the restarts after a case killed the child

    def prepare(self) -> Bases:
        """Starts the child if none is running, and has it make (or find) the bases and load them once."""
        if self.process is not None and self.process.is_alive():
            return self.bases
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=child_main, args=(child_conn, str(self.log_path)), daemon=True)
        self.process.start()
        child_conn.close()
        self.num_starts += 1
        self.summarised = set()
        reply = self._call(("prepare", str(self.cache_dir)), PREPARE_TIME_S, None)
        if reply.ending != "done":
            raise RuntimeError(f"the fuzzer's child failed to start ({reply.ending}); see {self.log_path}")
        self.bases = reply.result
        return self.bases

    def run_case(self, target: str, path: str, base: str | None, time_limit_s: float, memory_limit_kib: int) -> Reply:
        """One case; `base`: the Bases field it was made from (None: the target's first base)."""
        self.prepare()
        if base is not None and base not in self.summarised:  # outside the case's own time and memory
            if self._call(("base", base), PREPARE_TIME_S, None).ending != "done":
                raise RuntimeError(f"the fuzzer's child failed to load the base {base}; see {self.log_path}")
            self.summarised.add(base)
        return self._call(("case", target, path, base), time_limit_s, memory_limit_kib)

    def serve(self, time_limit_s: float) -> Reply:
        self.prepare()
        return self._call(("serve",), time_limit_s, None)

    def close(self) -> None:
        if self.process is not None:
            self.conn.close()  # the child's cue to stop its template workers and exit
            self.process.join(5)
            self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process = None

    def _call(self, message: tuple, time_limit_s: float, memory_limit_kib: int | None) -> Reply:
        """Sends `message` and waits for its answer, watching the child's clock and memory."""
        self.conn.send(message)
        start, baseline = time.monotonic(), _rss_kib(self.process.pid)
        reply = Reply("done")
        while True:
            reply.seconds = time.monotonic() - start
            if not self.conn.poll(POLL_S):
                if not self.process.is_alive():
                    return self._ended(reply, "died")
                if reply.seconds > time_limit_s:
                    return self._ended(reply, "hang")
                growth = _rss_kib(self.process.pid) - baseline
                reply.growth_kib = max(reply.growth_kib, growth)
                if memory_limit_kib is not None and growth > memory_limit_kib:
                    return self._ended(reply, "memory")
                continue
            try:
                kind, payload = self.conn.recv()
            except (EOFError, ConnectionResetError):
                return self._ended(reply, "died")
            if kind == "start":
                baseline = payload
            elif kind == "step":
                reply.step = payload
                reply.steps_begun.append(payload)
            elif kind == "error":
                raise RuntimeError(f"the fuzzer's child failed on {message}:\n{payload}")
            else:
                reply.result = payload
                return reply

    def _ended(self, reply: Reply, ending: str) -> Reply:
        reply.ending = ending
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        reply.exit_code = self.process.exitcode
        self.process = None
        return reply


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
