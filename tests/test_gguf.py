"""GGUF files as checkpoints (coreserve/worker/models/gguf_*.py, coreserve/protocol/gguf_header.py): every supported tensor
type dequantizes to exactly the values transformers' GGUF loader gives, q/k in HF's row order; a GGUF
runs to the same numbers as its safetensors twin, in process, spawned and as a daemon (the tokenizer
fingerprint agrees across processes); what is not supported is refused by name."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import HF_TOLERANCE, hf_logprobs, running_daemon
from gguf_files import SPEC, write_gguf_model, write_twin

from coreserve import LLM, SamplingParams
from coreserve.frontend.engine.engine_args import load_tokenizer
from coreserve.frontend.engine.gguf_tokenizer import gguf_tokenizer_folder
from coreserve.protocol.model_facts import eos_token_ids, tokenizer_fingerprint
from coreserve.worker.models.gguf_weights import SUPPORTED_TYPES
from coreserve.worker.models.loader import load_model

ALL_TYPES = [
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "MXFP4",
]
UNIFORM_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]
WEIGHT_CHECK_VOCAB = 512  # rows of the embeddings in the files only the weights are read from
PROMPT_IDS = [[50256, 464, 3139, 286, 4881, 318], [15496, 11, 616, 1438, 318, 257, 1332, 13, 383, 1110]]


def _mixed_types() -> dict[str, str]:
    """Each supported type on at least one matrix (q and k among them: their rows are permuted)."""
    names = ["model.embed_tokens.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{m}.weight"
        for i in range(SPEC.num_layers)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    ]
    return {name: ALL_TYPES[i % len(ALL_TYPES)] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[str, dict[str, np.ndarray], str]:
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "mixed.gguf"
    expected = write_gguf_model(path, _mixed_types())
    twin = write_twin(folder / "twin", expected, gguf_tokenizer_folder(str(path)))
    return str(path), expected, twin


@pytest.fixture(scope="module")
def mixed_small(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf_small") / "mixed.gguf"
    return str(path), write_gguf_model(path, _mixed_types(), vocab_size=WEIGHT_CHECK_VOCAB)


def _engine_params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def _as_hf(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's fused q/k/v and gate/up split back into HF's tensors."""
    q_size, kv_size, inter = (
        SPEC.num_heads * SPEC.head_dim,
        SPEC.num_kv_heads * SPEC.head_dim,
        SPEC.intermediate_size,
    )
    out = {"model.embed_tokens.weight": params["embed_tokens.weight"], "model.norm.weight": params["norm.weight"],
           "lm_head.weight": params["lm_head.weight"]}
    for i in range(SPEC.num_layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = params[p + "qkv_proj.weight"].split([q_size, kv_size, kv_size])
        gate, up = params[p + "gate_up_proj.weight"].split([inter, inter])
        out.update({hf + "self_attn.q_proj.weight": q, hf + "self_attn.k_proj.weight": k,
                    hf + "self_attn.v_proj.weight": v, hf + "mlp.gate_proj.weight": gate,
                    hf + "mlp.up_proj.weight": up, hf + "self_attn.o_proj.weight": params[p + "o_proj.weight"],
                    hf + "mlp.down_proj.weight": params[p + "down_proj.weight"],
                    hf + "input_layernorm.weight": params[p + "input_layernorm.weight"],
                    hf + "post_attention_layernorm.weight": params[p + "post_attention_layernorm.weight"]})
    return out


def test_every_supported_type_dequantizes_to_the_values_transformers_loads(mixed_small):
    from transformers import AutoModelForCausalLM

    path, expected = mixed_small
    assert set(_mixed_types().values()) == set(SUPPORTED_TYPES.values()) == set(ALL_TYPES)
    ours = _as_hf(_engine_params(load_model(path, "float32", torch.device("cpu"))))
    hf = AutoModelForCausalLM.from_pretrained(
        str(Path(path).parent), gguf_file=Path(path).name, dtype=torch.float32
    )
    reference = hf.state_dict()
    for name, values in expected.items():
        assert torch.equal(reference[name], torch.from_numpy(values)), name  # the helper's own reading
        assert torch.equal(ours[name], reference[name]), (name, _mixed_types().get(name))


@pytest.mark.parametrize("type_name", UNIFORM_TYPES)
def test_a_gguf_of_each_type_loads_the_numbers_of_its_safetensors_twin(tmp_path, type_name):
    expected = write_gguf_model(
        tmp_path / "m.gguf", {}, default_type=type_name, vocab_size=WEIGHT_CHECK_VOCAB
    )
    twin = write_twin(tmp_path / "twin", expected, gguf_tokenizer_folder(str(tmp_path / "m.gguf")))
    for dtype in ("float32", "bfloat16"):
        ours = _engine_params(load_model(str(tmp_path / "m.gguf"), dtype, torch.device("cpu")))
        theirs = _engine_params(load_model(twin, dtype, torch.device("cpu")))
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert ours[name].dtype == getattr(torch, dtype) and torch.equal(ours[name], theirs[name]), name


def _run(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    return llm.generate([{"prompt_token_ids": ids} for ids in PROMPT_IDS], params)


def _numbers(outputs: list) -> list:
    return [
        (o.outputs[0].token_ids, [[(t, v.logprob, v.rank) for t, v in d.items()] for d in o.outputs[0].logprobs],
         [None if d is None else sorted((t, v.logprob) for t, v in d.items()) for d in o.prompt_logprobs])
        for o in outputs
    ]


@pytest.mark.fp32_exact("the twin and HF reference are compared in fp32")
def test_the_engine_on_a_gguf_gives_its_twins_numbers_and_hfs(mixed):
    from transformers import AutoModelForCausalLM

    path, _, twin = mixed
    with LLM(path, multiprocess=False, num_kv_blocks=64) as llm:
        from_gguf = _run(llm)
    with LLM(twin, multiprocess=False, num_kv_blocks=64) as llm:
        from_twin = _run(llm)
    assert _numbers(from_gguf) == _numbers(from_twin)
    hf = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    for ids, out in zip(PROMPT_IDS, from_gguf):
        reference = hf_logprobs(hf, ids + out.outputs[0].token_ids[:-1])
        for position, token_id in enumerate(out.outputs[0].token_ids):
            row = reference[len(ids) - 1 + position]
            assert token_id == int(row.argmax())
            assert (
                abs(out.outputs[0].logprobs[position][token_id].logprob - float(row[token_id]))
                <= HF_TOLERANCE
            )


def test_a_spawned_core_and_a_daemon_agree_on_the_gguf_tokenizer(mixed, tmp_path):
    path, _, twin = mixed
    with LLM(path, num_kv_blocks=64) as llm:
        spawned = _numbers(_run(llm))
    address = f"ipc://{tmp_path}/core"
    with running_daemon(path, address):
        with pytest.raises(Exception, match="tokenizer"):
            LLM(twin, core_address=address)  # the same vocabulary from other files is another fingerprint
        with LLM(path, core_address=address) as llm:  # the refused client left the daemon serving
            assert _numbers(_run(llm)) == spawned
            assert llm.get_tokenizer().decode([464, 3139]) == "The capital"


def test_the_tokenizer_fingerprint_is_the_tokenizer_metadata_and_the_conversion_is_cached(mixed, tmp_path):
    path, _, _ = mixed
    other = tmp_path / "other.gguf"
    write_gguf_model(other, {}, default_type="F16")  # other weights, the same tokenizer
    assert tokenizer_fingerprint(str(other)) == tokenizer_fingerprint(path)
    assert eos_token_ids(path) == [50256]
    folder = gguf_tokenizer_folder(path)
    assert gguf_tokenizer_folder(str(other)) == folder
    start = time.monotonic()
    tokenizer = load_tokenizer(str(other))
    assert time.monotonic() - start < 5  # a cached folder, no conversion
    assert tokenizer("The capital of France is").input_ids == [464, 3139, 286, 4881, 318]


def _write_with(path: Path, arch: str = "llama", extra_tensor: tuple[str, np.ndarray] | None = None) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    if extra_tensor is not None:
        writer.add_tensor(*extra_tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architectures_tensor_types_and_rope_tensors_are_refused_by_name(tmp_path):
    _write_with(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_model(str(tmp_path / "gpt2.gguf"), "float32", torch.device("cpu"))
    _write_with(tmp_path / "f64.gguf", extra_tensor=("output.weight", np.zeros((8, 32), dtype=np.float64)))
    with pytest.raises(ValueError, match="F64"):
        list(
            __import__("coreserve.worker.models.gguf_weights", fromlist=["x"]).list_tensors(str(tmp_path / "f64.gguf"))
        )
    _write_with(tmp_path / "rope.gguf", extra_tensor=("rope_freqs.weight", np.ones(16, dtype=np.float32)))
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model(str(tmp_path / "rope.gguf"), "float32", torch.device("cpu"))
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        tokenizer_fingerprint(str(tmp_path / "bad.gguf"))


@pytest.mark.parametrize("key, value", [
    ("llama.rope.scaling.factor", [2.0, 4.0]),
    ("llama.rope.scaling.factor", None),  # a scaling type without its factor
    ("llama.rope.scaling.original_context_length", "4096"),
    ("llama.rope.scaling.factor", float("inf")),
])
def test_a_rope_key_that_is_not_a_number_is_refused_by_name(mixed, key, value):
    """float() or int() of an array, a string or a missing key was a TypeError or a KeyError: each is a
    ValueError naming the key (gguf_rope.meta_number)."""
    import dataclasses

    from coreserve.protocol.gguf_header import read_gguf_header
    from coreserve.worker.models.gguf_config import hf_config_from_gguf

    header = read_gguf_header(mixed[0])
    metadata = {**header.metadata, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.0}
    metadata = {k: v for k, v in {**metadata, key: value}.items() if v is not None}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        hf_config_from_gguf(dataclasses.replace(header, metadata=metadata))
