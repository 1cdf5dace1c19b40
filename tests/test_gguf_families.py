"""GGUF files of the families issue 41 added (qwen3moe, olmoe, llama with experts = Mixtral, phi3 with
and without LongRoPE and partial rotary, gemma2, gemma3), written as llama.cpp's converter writes them
(tests/gguf_families.py): the engine on the GGUF gives its safetensors twin's numbers bit for bit, and
the twin is within HF_TOLERANCE of HF's; Q8_0 weights kept in their blocks (experts too) give the bits
of their fp32 dequantization.
"""

from __future__ import annotations

import pytest
from conftest import HF_TOLERANCE, hf_logprobs, load_hf
from gguf_families import write_family_gguf, write_family_twin

from coreserve import LLM, SamplingParams
from coreserve.frontend.engine.gguf_tokenizer import gguf_tokenizer_folder
from coreserve.worker.models.quantized import QuantLinear

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "phi3", "phi4-mini", "gemma2", "gemma3"]
PROMPTS = [[(7 * i + 3 * j) % 20000 + 100 for j in range(n)] for i, n in enumerate((5, 23, 40, 61))]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3, prompt_logprobs=3),
    SamplingParams(temperature=0.8, seed=5, max_tokens=32, ignore_eos=True, logprobs=3),
]


def numbers(outputs) -> list:
    return [
        (o.outputs[0].token_ids, [[(t, v.logprob, v.rank) for t, v in d.items()] for d in o.outputs[0].logprobs],
         None if o.prompt_logprobs is None else
         [None if d is None else sorted((t, v.logprob) for t, v in d.items()) for d in o.prompt_logprobs])
        for o in outputs
    ]


def run(path: str, kept_in_blocks: list | None = None, **engine_args) -> list:
    """The prompts' outputs; `kept_in_blocks` gets the names of the model's layers kept in GGUF blocks."""
    with LLM(path, multiprocess=False, max_num_batched_tokens=16, **engine_args) as llm:
        if kept_in_blocks is not None:
            model = llm.client.core.executor.model
            kept_in_blocks.extend(n for n, m in model.named_modules() if isinstance(m, QuantLinear))
        prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
        return llm.generate(prompts, [PARAMS[i % 2] for i in range(len(PROMPTS))], use_tqdm=False)


@pytest.mark.fp32_exact("the GGUF and its twin are compared in fp32")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_gguf_gives_its_twins_numbers_and_the_twin_hfs(family, family_model, tmp_path):
    source = family_model(family)
    path = tmp_path / f"{family}.gguf"
    expected = write_family_gguf(source, family, path)
    twin = write_family_twin(tmp_path / "twin", source, expected, gguf_tokenizer_folder(str(path)))
    from_gguf = run(str(path), dtype="float32")
    assert numbers(from_gguf) == numbers(run(twin, dtype="float32"))
    if family == "phi4-mini":
        return  # LongRoPE past the switch: HF's single forward is not its decoding (test_model_families)
    hf = load_hf(twin)
    for i, (ids, output) in enumerate(zip(PROMPTS, from_gguf)):
        completion = output.outputs[0]
        reference = hf_logprobs(hf, ids + completion.token_ids[:-1])
        for step, (token_id, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[len(ids) - 1 + step]
            if PARAMS[i % 2].temperature == 0:  # greedy: HF's argmax
                assert row[token_id] >= row.max() - HF_TOLERANCE
            for entry_id, logprob in entries.items():
                assert abs(logprob.logprob - row[entry_id].item()) < HF_TOLERANCE


@pytest.mark.fp32_exact("blocks against their fp32 dequantization")
@pytest.mark.parametrize("family", ["qwen3_moe", "gemma2"])
def test_q8_0_weights_kept_in_blocks_give_their_dequantizations_bits(family, family_model, tmp_path):
    source = family_model(family)
    path = tmp_path / f"{family}-q8_0.gguf"
    write_family_gguf(source, family, path, weight_type="Q8_0")
    kept: list[str] = []
    assert numbers(run(str(path), kept)) == numbers(run(str(path), dtype="float32"))  # auto: kept in blocks
    assert any(name.endswith("qkv_proj") for name in kept)
    assert family != "qwen3_moe" or any(".experts." in name for name in kept)  # experts too
