"""The untrusted-input fuzzer's child process (tests/untrusted_fuzz.py starts it, spawned, and restarts it
when a case kills or hangs it): it loads each case's input the way the engine does and says how that
ended, with the case's seconds and peak memory growth.

A model file goes through the frontend's chain (check_model_folder, tokenizer_fingerprint, load_tokenizer,
generation_defaults) and the core's (load_model with dtype "auto" on the CPU, eos_token_ids), each chain
stopping at its first error, as the process would. An adapter goes through coreserve/worker/lora/adapter.py's
read_adapter against the tiny model; a chat template through chat_render_args in the engine's TemplateSandbox
with its default limits. A step that loads returns a summary, compared with the base's, so that an
accepted mutation can be told from one that silently changed the model.

Messages on the pipe: ("prepare", cache_dir) -> Bases; ("base", name) -> ("done", None), the hybrid base
`name` (a Bases field) loaded once for the comparison, before its first case; ("case", target, path, base) ->
("start", rss KiB), then ("step", name)s, then ("done", result); ("serve",) -> ("done", what a real LLM(None)
answered).
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Bonjour, 日本語 ? 🎉"}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROBE = "Hello, my name is 日本語 🎉"
MAX_LORA_RANK = 16  # coreserve/protocol/config.py's default max_lora_rank


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB: VmRSS (resident now) or VmHWM (the peak since reset_peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)


def child_main(conn, log_path: str) -> None:
    """Serves the parent's messages until the pipe closes; the loaders' own output goes to `log_path`."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    state = _State()
    while True:
        try:
            message = conn.recv()
        except EOFError:
            state.close()
            return
        try:
            if message[0] == "prepare":
                conn.send(("done", state.prepare(Path(message[1]))))
            elif message[0] == "base":
                conn.send(("done", state.summarise("model", getattr(state.bases, message[1]), message[1])))
            elif message[0] == "case":
                conn.send(("done", run_case(state, conn, *message[1:])))
            else:
                conn.send(("done", serve_check()))
        except Exception:  # the harness's own error: the parent stops the run with it
            conn.send(("error", traceback.format_exc()))


class _State:
    """What the checks share: the bases' summaries, the tiny model (adapters load against it), the tiny
    tokenizer and the template sandbox."""

    sandbox = None

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def prepare(self, cache_dir: Path):
        import torch
        from untrusted_fuzz_bases import make_bases

        from coreserve.frontend.engine.engine_args import load_tokenizer
        from coreserve.frontend.engine.engine_parts import template_sandbox
        from coreserve.worker.models.loader import load_model

        self.bases = make_bases(cache_dir)
        self.tiny = load_model(self.bases.hf, "auto", torch.device("cpu"))
        self.tokenizer = load_tokenizer(self.bases.hf)
        self.sandbox = template_sandbox(None, None, self.tiny.args.max_position_embeddings)
        self.summaries = {}
        bases = (("model", self.bases.gguf), ("model", self.bases.hf), ("lora", self.bases.lora), ("template", "base"))
        for target, path in bases:
            self.summarise(target, path, _base_key(target, path, None))
        return self.bases

    def summarise(self, target: str, path: str, key: str) -> None:
        """The base's load, what its cases' loads are compared with."""
        steps = CHECKS[target](self, path, lambda step: None)
        failed = [s for s in steps if s["outcome"] != "ok"]
        if failed:
            raise RuntimeError(f"the base {path} does not load: {failed}")
        self.summaries[key] = {s["step"]: s["summary"] for s in steps}


def _base_key(target: str, path: str, base: str | None) -> str:
    return base or f"{target}:{'gguf' if path.endswith('.gguf') else 'folder'}"


def run_case(state: _State, conn, target: str, path: str, base: str | None) -> dict:
    """The case's steps (each with its outcome and, where it loaded, what differs from the base's load), its
    seconds and its peak resident growth in KiB."""
    gc.collect()
    reset_peak()
    before = status_kib("VmRSS")
    conn.send(("start", before))
    start = time.monotonic()
    steps = CHECKS[target](state, path, lambda step: conn.send(("step", step)))
    seconds = time.monotonic() - start
    growth = status_kib("VmHWM") - before
    base = state.summaries[_base_key(target, path, base)]
    for step in steps:
        if step["outcome"] == "ok":  # what it loaded that the base's load did not: {part: value}
            parts, base_parts = step.pop("summary"), base.get(step["step"], {})
            step["changed"] = {k: _short_text(v) for k, v in parts.items() if base_parts.get(k) != v}
    return {"steps": steps, "seconds": seconds, "growth_kib": growth}


def _run_chain(chain: str, steps: list[tuple[str, Callable[[], object]]], report: Callable[[str], None]) -> list[dict]:
    """Each step in turn until one fails, as the process would stop there."""
    done = []
    for name, call in steps:
        report(name)
        try:
            loaded = call()
            parts = loaded if isinstance(loaded, dict) else {"value": loaded}
            summary = {k: repr(v) for k, v in parts.items()}
            done.append({"chain": chain, "step": name, "outcome": "ok", "summary": summary})
        except (Exception, SystemExit) as exc:
            done.append({"chain": chain, "step": name, **describe_error(exc)})
            break
    return done


def describe_error(exc: BaseException) -> dict:
    """A refusal (the engine's ValueError: a plain one, or a subclass of ours) or a crash (anything else,
    json's and Unicode's ValueError subclasses included), its message and where it was raised."""
    own = isinstance(exc, ValueError) and (type(exc) is ValueError or _is_ours(sys.modules.get(type(exc).__module__)))
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if _is_ours_path(f.filename)]
    where = [f"{Path(f.filename).resolve().relative_to(ROOT)}:{f.lineno} in {f.name}" for f in ours[-1:]]
    if frames and (not ours or frames[-1] is not ours[-1]):
        where.append(f"raised in {_short(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}")
    return {"outcome": "refused" if own else "crash", "type": type(exc).__name__, "message": str(exc)[:500],
            "where": "; ".join(where)}


def _is_ours(module) -> bool:
    return module is not None and _is_ours_path(getattr(module, "__file__", None) or "")


def _is_ours_path(filename: str) -> bool:
    """A file of the engine (not the tests, not an installed package)."""
    if not Path(filename).is_absolute():  # "<frozen codecs>", "<string>"
        return False
    parts = Path(filename).resolve().parts
    return parts[: len(ROOT.parts)] == ROOT.parts and parts[len(ROOT.parts) : len(ROOT.parts) + 1] not in (
        (), ("tests",), (".venv",), ("scripts",))


def _short(filename: str) -> str:
    """A package's file from its package folder; the standard library's by its last two parts."""
    parts = Path(filename).parts
    return "/".join(parts[parts.index("site-packages") + 1 :] if "site-packages" in parts else parts[-2:])


def check_model(state: _State, path: str, report: Callable[[str], None]) -> list[dict]:
    import torch

    from coreserve.frontend.engine.engine_args import load_tokenizer
    from coreserve.frontend.engine.model_checks import check_model_folder
    from coreserve.protocol.model_facts import eos_token_ids, generation_defaults, tokenizer_fingerprint
    from coreserve.worker.models.loader import load_model

    def tokenizer() -> dict:
        loaded = load_tokenizer(path)
        return {"size": len(loaded), "probe ids": loaded.encode(PROBE)}

    def model() -> dict:
        loaded = load_model(path, "auto", torch.device("cpu"))
        return {**{f"args.{k}": v for k, v in vars(loaded.args).items()}, **_weights_digest(loaded)}

    frontend = [("check_model_folder", lambda: check_model_folder(path, has_weights_here=True)),
                ("tokenizer_fingerprint", lambda: tokenizer_fingerprint(path) and None), ("load_tokenizer", tokenizer),
                ("generation_defaults", lambda: generation_defaults(path))]
    core = [("load_model", model), ("eos_token_ids", lambda: eos_token_ids(path))]
    return _run_chain("frontend", frontend, report) + _run_chain("core", core, report)


def _weights_digest(model) -> dict[str, str]:
    """Each tensor's shape and sum (in float64; integer blocks as integers): NaN where one is not finite."""
    import torch

    def digest(t: torch.Tensor) -> str:
        total = torch.sum(t, dtype=torch.float64 if t.is_floating_point() else torch.int64)
        return f"{list(t.shape)} sum {float(total):.6g}"

    return {name: digest(t) for name, t in model.state_dict().items()}


def _short_text(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def check_lora(state: _State, path: str, report: Callable[[str], None]) -> list[dict]:
    from coreserve.worker.lora.adapter import read_adapter

    def adapter() -> dict:
        loaded = read_adapter(path, "fuzz", state.tiny, MAX_LORA_RANK)
        parts = [(p.scale, p.start, float(p.a.weight.double().sum()), float(p.b.weight.double().sum()))
                 for deltas in loaded.deltas.values() for p in deltas]
        return {"rank": loaded.rank, "bytes": loaded.num_bytes, "parts": sorted(parts)}

    return _run_chain("core", [("read_adapter", adapter)], report)


def check_template(state: _State, path: str, report: Callable[[str], None]) -> list[dict]:
    from coreserve.frontend.engine.chat_template import chat_render_args

    template = CHATML if path == "base" else Path(path).read_text()

    def render() -> dict:
        return {"characters": len(state.sandbox.render(*chat_render_args(state.tokenizer, MESSAGES, template, True)))}

    return _run_chain("frontend", [("render", render)], report)


CHECKS = {"model": check_model, "lora": check_lora, "template": check_template}


def serve_check() -> dict:
    """A real engine (LLM(None): the built-in tiny model, its core in this process, the one that loaded
    every case) after the run: it answers a request, refuses a hostile chat template, and answers a chat."""
    from coreserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0)
    with LLM(None, multiprocess=False) as llm:
        tokens = list(llm.generate(["Hello, my name is"], params, use_tqdm=False)[0].outputs[0].token_ids)
        try:
            llm.chat(MESSAGES, params, chat_template="{{ 'x' * 10**9 }}", use_tqdm=False)
            refusal = "accepted"
        except ValueError as exc:
            refusal = f"refused: {exc}"
        chat = list(llm.chat(MESSAGES, params, chat_template=CHATML, use_tqdm=False)[0].outputs[0].token_ids)
    return {"ok": len(tokens) == 4 and len(chat) == 4 and refusal.startswith("refused"), "tokens": tokens,
            "chat_tokens": chat, "hostile_template": refusal[:200]}
