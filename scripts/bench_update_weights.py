"""update_weights of a model's whole state across the process boundary (target: <= 0.5 s for the 135M
SmolLM2), with its breakdown: write (the frontend's safetensors file in /dev/shm), the core's round
trip, and inside the core, load (validate and copy in place) and derive (the fused forward rebuilt).
The load and derive times are measured on a model in this process, from the same file.

    .venv/bin/python scripts/bench_update_weights.py [--model builtin:smollm2] [--repeats 5]

Prints a table and writes JSON (--out). The machine is shared and noisy: note its load beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_out/update_weights.json")
    args = parser.parse_args()

    import torch

    from engine_core.core import EngineCore
    from frontend import LLM
    from frontend.rl_control import write_safetensors
    from protocol.builtin_model import builtin_model_path
    from protocol.config import EngineConfig
    from worker.models.weight_update import update_weights_from_path

    model = builtin_model_path(args.model[8:]) if args.model.startswith("builtin:") else args.model
    core = EngineCore(EngineConfig(model=model, num_kv_blocks=64))
    control = core.control.control  # the in-process runner's RunnerControl
    state = [(name, p.detach().clone()) for name, p in _hf_named(core.executor.model)]
    folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(folder, "model.safetensors")
    num_bytes = write_safetensors(state, path)
    loads, derives = [], []
    for _ in range(args.repeats):
        begun = time.perf_counter()
        update_weights_from_path(core.executor.model, path)
        loaded = time.perf_counter()
        control._rederive()
        loads.append(loaded - begun)
        derives.append(time.perf_counter() - loaded)
    core.close()
    os.remove(path)
    os.rmdir(folder)

    writes, trips, totals = [], [], []
    with LLM(model, num_kv_blocks=64) as llm:
        for _ in range(args.repeats):
            llm.update_weights(state)
            timings = llm._rl_control().last_timings
            writes.append(timings["write"])
            trips.append(timings["core"])
            totals.append(timings["total"])
    rows = {"write": writes, "core round trip": trips, "total": totals, "core: load": loads,
            "core: derive": derives}  # fmt: skip
    print(f"{args.model}: {num_bytes / 2**20:.0f} MiB of weights, {len(state)} tensors, load avg "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    for name, values in rows.items():
        print(f"{name:>18}: median {statistics.median(values):.3f} s  min {min(values):.3f} s")
    result = {name: values for name, values in rows.items()}
    result.update(model=args.model, bytes=num_bytes, loadavg=os.getloadavg()[0], torch=torch.__version__)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


def _hf_named(model):
    """The engine model's weights under HF names (fused row blocks split back)."""
    from worker.models.loader import _destination

    a = model.args
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not a.tie_word_embeddings:
        names.append("lm_head.weight")
    parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]  # fmt: skip
    names += [f"model.layers.{i}.{part}.weight" for i in range(a.num_layers) for part in parts]
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in names:
        target, rows = _destination(a, name)
        yield name, params[target].data[rows] if rows is not None else params[target].data


if __name__ == "__main__":
    main()
