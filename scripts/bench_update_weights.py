"""update_weights of a model's whole state across the process boundary (target: <= 0.5 s for the 135M
SmolLM2), with its breakdown: write (the frontend's safetensors file in /dev/shm), wire (the command
and reply, the round trip less the core's part), and in the core: check (tensor parallel: every rank's
checks before any copies), load (checks and copies in place; with TP the slowest rank), derive (the
fused forward rebuilt over the new weights' addresses), reset_prefix_cache.

    .venv/bin/python scripts/bench_update_weights.py [--model builtin:smollm2] [--repeats 5]
        [--daemon] [--tensor-parallel-size 2] [--num-threads N] [--dtype float32]

--daemon starts `python -m coreserve.engine_core` on an ipc socket and attaches to it (else the frontend spawns
its core). The first --first updates run right after the engine starts, as an RL loop's first syncs
do (the core may still be collapsing its weights into huge pages then), and are reported beside the
settled median. Prints a table and writes JSON (--out). The machine is shared and noisy: note its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("write", "wire", "check", "load", "derive", "reset_prefix_cache", "total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--settle", type=float, default=12.0,
                        help="seconds between start and the first update: a new core spends its first "
                        "idle seconds collapsing its weights into huge pages (coreserve/worker/cpu/huge_pages.py)")
    parser.add_argument("--first", type=int, default=3,
                        help="updates right after the engine starts (reported apart), before the settling")
    parser.add_argument("--daemon", action="store_true", help="through an attached daemon")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=None, help="the core's torch threads")
    parser.add_argument(
        "--dtype", default="float32", help="the engine's (a GGUF kept quantized takes no update)"
    )
    parser.add_argument("--out", default="bench_out/update_weights.json")
    args = parser.parse_args()

    import torch

    from coreserve.engine_core.core import EngineCore
    from coreserve.protocol.builtin_model import builtin_model_path
    from coreserve.protocol.config import EngineConfig

    model = builtin_model_path(args.model[8:]) if args.model.startswith("builtin:") else args.model
    engine = {"num_kv_blocks": 64, "tensor_parallel_size": args.tensor_parallel_size, "dtype": args.dtype}
    if args.num_threads:
        engine["num_threads"] = args.num_threads
    core = EngineCore(EngineConfig(model=model, num_kv_blocks=64, dtype=args.dtype))  # the engine's dtypes
    state = list(_hf_named(core.executor.model))  # the trainer's side: HF names, copies of its own
    core.close()
    rounds: dict[str, list[float]] = {phase: [] for phase in PHASES}
    first: dict[str, list[float]] = {phase: [] for phase in PHASES}
    with _engine(model, engine, args.daemon) as llm:
        for _ in range(args.first):  # as an RL loop does: its first syncs right after the engine starts
            llm.update_weights(state)
            for phase in PHASES:
                first[phase].append(llm.engine.last_update_timings.get(phase, 0.0))
        time.sleep(args.settle)  # a long-running RL engine's steady state, not its first seconds
        for _ in range(args.repeats):
            llm.update_weights(state)
            timings = llm.engine.last_update_timings
            for phase in PHASES:
                rounds[phase].append(timings.get(phase, 0.0))
    num_bytes = sum(t.numel() * t.element_size() for _, t in state)
    mode = f"{'daemon' if args.daemon else 'spawned core'}, TP={args.tensor_parallel_size}"
    print(f"{args.model} ({mode}): {num_bytes / 2**20:.0f} MiB of weights, {len(state)} tensors, "
          f"load avg {os.getloadavg()[0]:.1f}")
    for phase, values in rounds.items():
        starts = " ".join(f"{v:.3f}" for v in first[phase])
        print(f"{phase:>18}: settled median {statistics.median(values):.3f} s  min {min(values):.3f} s"
              f"   right after start: {starts} s")
    result = dict(rounds, first_after_start=first, model=args.model, mode=mode, bytes=num_bytes,
                  loadavg=os.getloadavg()[0], torch=torch.__version__)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


@contextmanager
def _engine(model: str, engine: dict, is_daemon: bool):
    from coreserve import LLM

    if not is_daemon:
        with LLM(model, **engine) as llm:
            yield llm
        return
    folder = tempfile.mkdtemp(prefix="coreserve-bench-")
    address = f"ipc://{folder}/core"
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in engine.items()]
    command = [sys.executable, "-m", "coreserve.engine_core", "--model", model, "--address", address, *flags]
    daemon = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        while not os.path.exists(f"{folder}/core.in"):  # it binds once its model is loaded
            if daemon.poll() is not None:
                raise SystemExit(f"the daemon exited with code {daemon.returncode}")
            time.sleep(0.1)
        with LLM(model, core_address=address) as llm:
            yield llm
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)


def _hf_named(model):
    """The engine model's weights under HF names (fused row blocks split back)."""
    from coreserve.worker.models.weight_names import weight_destination

    a = model.args
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not a.tie_word_embeddings:
        names.append("lm_head.weight")
    parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    names += [f"model.layers.{i}.{part}.weight" for i in range(a.num_layers) for part in parts]
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in names:
        target, rows = weight_destination(a, name)
        yield name, (params[target].data[rows] if rows is not None else params[target].data).detach().clone()


if __name__ == "__main__":
    main()
