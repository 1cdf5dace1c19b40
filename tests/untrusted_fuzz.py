"""A fuzzer of the engine's untrusted inputs (issue 62; scripts/fuzz_untrusted.py, tests/test_untrusted_fuzz.py):
valid model files, adapters and chat templates mutated (tests/untrusted_fuzz_{gguf,hf,lora,templates}.py; the
hybrid models' folders and GGUF files: tests/untrusted_fuzz_hybrid*.py, Granite 4.0-H's untrusted_fuzz_granite*.py;
issue 65's: gpt-oss's untrusted_fuzz_gpt_oss*.py, OLMo 3's, SmolLM3's and Exaone 4's untrusted_fuzz_windows*.py,
Gemma 4's untrusted_fuzz_gemma4.py),
each loaded the way the engine loads it in a long-lived child process (tests/untrusted_fuzz_child.py),
which is killed past 10 s or 512 MiB of growth and started again. Each case ends:

- "refused": the engine's ValueError (its message should name the problem);
- "accepted": it loaded; acceptable only where the mutation is harmless, so each step that loaded says
  whether it loaded the same as the base, for a human to judge;
- "crash": any other exception (json's and Unicode's ValueError subclasses included), or the process died;
- "hang": past the time limit; "memory": past the memory limit (peak resident growth).

After the cases a real engine (LLM(None)) in the same child answers a request: the process that loaded
every case still serves. The cases: the named catalog first (the same in every run), then random ones,
each a deterministic function of (seed, index).
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import untrusted_fuzz_gemma4
import untrusted_fuzz_gguf
import untrusted_fuzz_gpt_oss
import untrusted_fuzz_granite
import untrusted_fuzz_hf
import untrusted_fuzz_hybrid
import untrusted_fuzz_lora
import untrusted_fuzz_templates
import untrusted_fuzz_windows
from untrusted_fuzz_supervisor import Child, Reply
from untrusted_mutation import Bases, Mutation

GROUPS = {"gguf": untrusted_fuzz_gguf, "hf": untrusted_fuzz_hf, "lora": untrusted_fuzz_lora,
          "template": untrusted_fuzz_templates, "hybrid": untrusted_fuzz_hybrid, "granite": untrusted_fuzz_granite,
          "gpt_oss": untrusted_fuzz_gpt_oss, "windows": untrusted_fuzz_windows, "gemma4": untrusted_fuzz_gemma4}
# how often a random case is of each group
RANDOM_WEIGHTS = {"gguf": 4, "hf": 3, "lora": 2, "template": 1, "hybrid": 3, "granite": 2, "gpt_oss": 2, "windows": 2,
                  "gemma4": 1}
OUTCOMES = ("refused", "accepted", "crash", "hang", "memory")
FAILING = ("crash", "hang", "memory")
TIME_LIMIT_S = 10.0
MEMORY_LIMIT_MIB = 512
SERVE_TIME_S = 120.0


@dataclass
class CaseResult:
    index: int
    kind: str
    description: str
    outcome: str  # one of OUTCOMES
    detail: str  # the refusal's or the crash's message and where; what an accepted case changed
    seconds: float
    growth_mib: float
    steps: list[dict] = field(default_factory=list)  # each step's outcome, type, message, where


@dataclass
class FuzzReport:
    results: list[CaseResult]
    serving: dict  # what the engine answered after the cases (tests/untrusted_fuzz_child.py's serve_check)
    seconds: float  # the whole run's
    prepare_seconds: float  # the first child's start: its imports, the bases made or found and loaded once
    serve_seconds: float
    num_starts: int  # child processes started: 1 + the restarts after a kill or a death

    @property
    def has_failed(self) -> bool:
        return any(r.outcome in FAILING for r in self.results) or not self.serving.get("ok")


def default_cache_dir() -> Path:
    from coreserve.protocol.builtin_model import default_cache_dir as coreserve_cache

    return coreserve_cache() / "untrusted-fuzz-v1"


def catalog(groups: tuple[str, ...] = tuple(GROUPS)) -> list[Mutation]:
    return [m for group in groups for m in GROUPS[group].catalog()]


def draw_cases(bases: Bases, seed: int, num_cases: int, first_case: int = 0,
               groups: tuple[str, ...] = tuple(GROUPS)) -> list[tuple[int, Mutation]]:
    """Cases first_case ... first_case + num_cases - 1: the catalog's, then random ones of (seed, index)."""
    named = catalog(groups)
    return [(i, named[i] if i < len(named) else drawn(bases, seed, i, groups))
            for i in range(first_case, first_case + num_cases)]


def drawn(bases: Bases, seed: int, index: int, groups: tuple[str, ...]) -> Mutation:
    rng = random.Random(f"{seed}:{index}")
    group = rng.choices(groups, [RANDOM_WEIGHTS[g] for g in groups])[0]
    return GROUPS[group].drawn(rng, bases)


def run_fuzz(pick: Callable[[Bases], list[tuple[int, Mutation]]], time_limit_s: float = TIME_LIMIT_S,
             memory_limit_mib: float = MEMORY_LIMIT_MIB, on_result: Callable[[CaseResult], None] | None = None,
             cache_dir: Path | None = None, log_path: Path | None = None) -> FuzzReport:
    """Runs the cases `pick` chooses (given the bases), then the serving check; `on_result` sees each case
    as it ends; `log_path`: where the child's own output goes (a scratch file by default)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="untrusted-fuzz-") as scratch:
        child = Child(cache_dir or default_cache_dir(), log_path or Path(scratch) / "child.log")
        try:
            bases = child.prepare()
            prepared = time.monotonic()
            results = []
            for index, mutation in pick(bases):
                results.append(run_case(child, bases, index, mutation, Path(scratch), time_limit_s, memory_limit_mib))
                if on_result is not None:
                    on_result(results[-1])
            serving = child.serve(SERVE_TIME_S)
        finally:
            child.close()
    served = serving.result if serving.ending == "done" else {"ok": False, "ending": serving.ending}
    return FuzzReport(results, served, time.monotonic() - start, prepared - start, serving.seconds, child.num_starts)


def run_case(child: Child, bases: Bases, index: int, mutation: Mutation, scratch: Path, time_limit_s: float,
             memory_limit_mib: float) -> CaseResult:
    folder = scratch / f"case-{index}"
    folder.mkdir()
    try:
        path = mutation.make(bases, folder)
        reply = child.run_case(mutation.target, path, mutation.base, time_limit_s, int(memory_limit_mib * 1024))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    outcome, detail = judge(reply, time_limit_s, memory_limit_mib)
    result = reply.result if reply.ending == "done" else {}
    growth = result.get("growth_kib", reply.growth_kib) / 1024
    return CaseResult(index, mutation.kind, mutation.description, outcome, detail,
                      round(result.get("seconds", reply.seconds), 3), round(growth, 1), result.get("steps", []))


def judge(reply: Reply, time_limit_s: float, memory_limit_mib: float) -> tuple[str, str]:
    """The case's outcome and the line that explains it."""
    if reply.ending == "hang":
        return "hang", f"killed after {time_limit_s:g} s, in {reply.step}"
    if reply.ending == "memory":
        return "memory", f"killed at {reply.growth_kib / 1024:.0f} MiB of growth, in {reply.step}"
    if reply.ending == "died":
        return "crash", f"the process died (exit code {reply.exit_code}), in {reply.step}"
    steps, growth_mib = reply.result["steps"], reply.result["growth_kib"] / 1024
    if growth_mib > memory_limit_mib:
        return "memory", f"grew {growth_mib:.0f} MiB (steps {[s['step'] for s in steps]})"
    if reply.result["seconds"] > time_limit_s:
        return "hang", f"took {reply.result['seconds']:.1f} s"
    for outcome in ("crash", "refused"):
        ended = [s for s in steps if s["outcome"] == outcome]
        if ended:
            first = ended[0]
            others = {s["chain"] for s in steps} - {first["chain"]}
            loaded = [c for c in sorted(others) if all(s["outcome"] == "ok" for s in steps if s["chain"] == c)]
            also = f" (the {' and '.join(loaded)} chain loaded it)" if loaded else ""
            return outcome, f"{first['step']}: {first['type']}: {first['message']} [{first['where']}]{also}"
    changed = [f"{s['step']}: {_parts(s['changed'])}" for s in steps if s["changed"]]
    return "accepted", f"loads differently from the base: {'; '.join(changed)}" if changed else "loads as the base does"


def _parts(changed: dict[str, str]) -> str:
    shown = [f"{k}={v}" for k, v in list(changed.items())[:3]]
    return ", ".join(shown) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")


def outcome_table(results: list[CaseResult]) -> str:
    """Cases by kind and outcome."""
    kinds = sorted({r.kind for r in results})
    counts = Counter((r.kind, r.outcome) for r in results)
    lines = [f"{'kind':<16}{'cases':>7}" + "".join(f"{o:>10}" for o in OUTCOMES)]
    for kind in [*kinds, "all"]:
        row = [r for r in results if kind in ("all", r.kind)]
        cells = [sum(counts[(k, o)] for k in kinds if kind in ("all", k)) for o in OUTCOMES]
        lines.append(f"{kind:<16}{len(row):>7}" + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def case_line(result: CaseResult) -> str:
    return (f"#{result.index} {result.outcome.upper()} [{result.kind}] {result.description} "
            f"({result.seconds:.1f} s, {result.growth_mib:+.0f} MiB): {result.detail}")
