"""What the GGUF fuzzer asks of one case (tests/gguf_fuzz.py), with the engine in process:

(a) the file run with its quantization kept (dtype "auto": Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/MXFP4 weights stay
    in their blocks) gives exactly the bits (==) of the same file dequantized to fp32 (dtype "float32"):
    sample and prompt logprobs, ids and ranks, each prompt alone and all batched;
(b) the fp32 run is within HF_TOLERANCE (relative where a logprob is larger than 1) of transformers on
    the safetensors twin, teacher-forced on the engine's tokens (token by token where the model has Gated
    DeltaNet layers);
(c) batch invariance (the engine's default on the C kernels): each prompt alone gives the bits it gives
    batched.

`check_case` returns each broken promise as one line; none is a pass. A converted family's case where llama.cpp's
converter is absent is skipped, with the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from gguf_fuzz import CONVERTED_FAMILIES, FuzzCase
from gguf_fuzz_convert import converter_missing
from gguf_fuzz_files import write_case

HF_TOLERANCE = 1e-4
# coreserve/worker/models/quantized.py's QUANT_TYPES
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")


@dataclass
class EngineRun:
    alone: list[dict]  # per request, run by itself: numbers()
    batched: list[dict]  # all requests in one generate call
    outputs: list  # the batched RequestOutputs
    kept: list[str]  # the model's modules kept in GGUF blocks


@dataclass
class CaseResult:
    case: FuzzCase
    failures: list[str]
    types: dict[str, tuple[str, str]] = field(default_factory=dict)  # GGUF tensor -> (asked, written)
    kept: list[str] = field(default_factory=list)
    hf_worst: float = 0.0  # the largest relative difference from HF's logprobs
    seconds: float = 0.0
    skipped: str = ""  # why the case did not run (a converted family without llama.cpp's converter)


def check_case(case: FuzzCase, folder: Path, llama_quantize: str | None = None) -> CaseResult:
    """(a), (b) and (c) for the case, its files written under `folder` (`llama_quantize`: the binary a
    LLAMA_QUANTIZE case needs)."""
    start = time.monotonic()
    if case.family in CONVERTED_FAMILIES and (reason := converter_missing()):
        return CaseResult(case, [], skipped=reason)
    files = write_case(case, folder, llama_quantize)
    kept, fp32 = run_engine(files.gguf, "auto", case), run_engine(files.gguf, "float32", case)
    failures = [
        *compare("kept blocks vs fp32, alone", kept.alone, fp32.alone),
        *compare("kept blocks vs fp32, batched", kept.batched, fp32.batched),
    ]
    if case.engine["can_use_cpu_kernels"]:  # the torch path's products round with the batch's shape
        failures += compare("batch invariance (fp32): alone vs batched", fp32.alone, fp32.batched)
    failures += [f"{module} not kept in blocks" for module in must_keep(files.types, case.config)
                 if module not in kept.kept]
    hf_failures, worst = against_hf(case, files.twin, fp32.outputs)
    return CaseResult(case, failures + hf_failures, files.types, kept.kept, worst, time.monotonic() - start)


def must_keep(types: dict[str, tuple[str, str]], config: dict) -> list[str]:
    """The modules that must stay in their blocks: those filled from one GGUF tensor of a kept type (the
    embedding, an untied output, o_proj, a dense down_proj, a recurrent mixer's out_proj where its columns
    move as whole blocks, if at all; a fused one waits for all its parts)."""
    modules = {"token_embd": "embed_tokens", "output": "lm_head", "attn_output": "o_proj", "ffn_down": "down_proj",
               "shortconv.out_proj": "conv.out_proj", "ssm_out": _mixer_out_proj(config)}
    names = []
    for name, (_, written) in types.items():
        parts = name.removesuffix(".weight").split(".")
        role = ".".join(parts[2:]) if parts[0] == "blk" else parts[0]
        module = modules.get(role)
        if written in KEPT_TYPES and module and (role != "ssm_out" or _moves_whole_blocks(config, written)):
            names.append(module if parts[0] != "blk" else f"layers.{parts[1]}.{module}")
    return names


def _mixer_out_proj(config: dict) -> str:
    return "mamba.out_proj" if config["model_type"] == "granitemoehybrid" else "linear_attn.out_proj"


def _moves_whole_blocks(config: dict, written: str) -> bool:
    """Whether a Gated DeltaNet's out_proj columns (value heads llama.cpp tiled, where a key head serves
    several) move as whole blocks of `written` (coreserve/worker/models/gguf_recurrent.py's TiledHeads)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if "linear_num_value_heads" not in config or config["linear_num_value_heads"] == config["linear_num_key_heads"]:
        return True
    return config["linear_value_head_dim"] % GGML_QUANT_SIZES[GGMLQuantizationType[written]][0] == 0


def run_engine(path: str, dtype: str, case: FuzzCase) -> EngineRun:
    from coreserve import LLM, SamplingParams
    from coreserve.worker.models.quantized import QuantEmbedding, QuantLinear

    params = [SamplingParams(**request) for request in case.requests]
    prompts = [{"prompt_token_ids": list(ids)} for ids in case.prompts]
    with LLM(path, dtype=dtype, multiprocess=False, **case.engine) as llm:
        model = llm.client.core.executor.model
        kept = [name for name, m in model.named_modules() if isinstance(m, QuantLinear | QuantEmbedding)]
        batched = llm.generate(prompts, params, use_tqdm=False)
        alone = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    return EngineRun([numbers(o) for o in alone], [numbers(o) for o in batched], batched, kept)


def numbers(output) -> dict:
    """A request's tokens, its listed (id, logprob, rank) a step, and its prompt logprobs likewise."""
    completion = output.outputs[0]
    return dict(
        tokens=list(completion.token_ids),
        sample=[[(t, v.logprob, v.rank) for t, v in d.items()] for d in completion.logprobs or []],
        prompt=[None if d is None else [(t, v.logprob, v.rank) for t, v in d.items()]
                for d in output.prompt_logprobs or []],
    )


def compare(what: str, got: list[dict], want: list[dict]) -> list[str]:
    """One line for the first request whose numbers differ (== on every float)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return [f"{what}: request {i}: {_first_difference(a, b)}"]
    return []


def _first_difference(a: dict, b: dict) -> str:
    if a["tokens"] != b["tokens"]:
        return f"tokens {a['tokens']} vs {b['tokens']}"
    for kind in ("sample", "prompt"):
        for position, (x, y) in enumerate(zip(a[kind], b[kind])):
            if x == y:
                continue
            pairs = [(e, f) for e, f in zip(x or [], y or []) if e != f] or [(x, y)]
            (e, f), error = pairs[0], _error(pairs[0])
            return f"{kind} logprobs at position {position}: {e} vs {f}{error}"
        if len(a[kind]) != len(b[kind]):
            return f"{kind} logprobs: {len(a[kind])} positions vs {len(b[kind])}"
    return "?"


def _error(pair: tuple) -> str:
    e, f = pair
    if isinstance(e, tuple) and isinstance(f, tuple) and e[0] == f[0]:
        return f" (difference {abs(e[1] - f[1]):.3g})"
    return ""


def against_hf(case: FuzzCase, twin: str, outputs: list) -> tuple[list[str], float]:
    """(b): every listed logprob of the fp32 run against transformers' on the twin, teacher-forced on the
    prompt and the engine's tokens; a greedy token is HF's argmax within the tolerance. Returns the
    failures and the largest relative difference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    failures, worst = [], 0.0
    for i, (prompt, request, output) in enumerate(zip(case.prompts, case.requests, outputs)):
        completion = output.outputs[0]
        sequence = list(prompt) + list(completion.token_ids[:-1])
        if _hf_forward_differs(case.config, len(sequence)):
            continue
        rows = _hf_rows(model, sequence, case.config)
        listed = [(len(prompt) - 1 + s, "sample", d) for s, d in enumerate(completion.logprobs or [])]
        listed += [(p - 1, "prompt", d) for p, d in enumerate(output.prompt_logprobs or []) if d is not None]
        for row, kind, entries in listed:
            for token, logprob in entries.items():
                error = _relative(logprob.logprob, rows[row, token].item())
                worst = max(worst, error)
                if error > HF_TOLERANCE:
                    failures.append(f"vs HF: request {i} {kind} row {row} token {token}: {logprob.logprob!r} vs "
                                    f"{rows[row, token].item()!r} (relative {error:.3g})")
                    break
        for step, token in enumerate(completion.token_ids if request["temperature"] == 0 else []):
            row = rows[len(prompt) - 1 + step]
            if _relative(row[token].item(), row.max().item()) > HF_TOLERANCE:
                failures.append(f"vs HF: request {i} greedy step {step}: token {token}, HF's argmax "
                                f"{row.argmax().item()} is {row.max().item() - row[token].item():.3g} higher")
    return failures[:5], worst


def _hf_rows(model, sequence: list[int], config: dict):
    """[len(sequence), vocab] float64 log_softmax of HF's logits at each position: one forward, or token by
    token where a Gated DeltaNet's one forward runs the chunked delta rule (Qwen3.5, Qwen3-Next), which is
    2.2e-4 from HF's own recurrence on qwen3_next-F32-seed1 (the engine: 4.6e-5 from the recurrence); its
    decoding runs the recurrence, as the engine does."""
    import torch

    with torch.no_grad():
        if "linear_num_key_heads" not in config:
            return torch.log_softmax(model(torch.tensor([sequence])).logits[0].double(), dim=-1)
        cache, logits = None, []
        for token in sequence:
            output = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = output.cache
            logits.append(output.logits[0, -1])
        return torch.log_softmax(torch.stack(logits).double(), dim=-1)


def _relative(got: float, want: float) -> float:
    return 0.0 if got == want else abs(got - want) / max(1.0, abs(want))


def _hf_forward_differs(config: dict, length: int) -> bool:
    """LongRoPE past its original context: HF's one forward takes the long factors for every position,
    its decoding (and the engine) only past the switch (tests/test_model_families.py)."""
    rope = config.get("rope_parameters") or {}
    return rope.get("rope_type") == "longrope" and length > rope["original_max_position_embeddings"]
