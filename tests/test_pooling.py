"""The pooling runner (runner="pooling", docs/serving.md "Pooling"): a causal LM as an embedder (HF's last
hidden state, normalized), a random Qwen2ForSequenceClassification and a reward model's one-label head (HF's
logits at the last non-pad token within 1e-4), a random bidirectional Gemma 3 with sentence-transformers
modules (mean pooling, two Dense layers, Normalize) against the same computed from HF's Gemma3TextModel;
each the same bits alone and batched; score's cosine; what is not built or does not apply, refused by name.
The real EmbeddingGemma-300M is scripts/check_embedding_gemma.py's (docs/serving.md)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import free_blocks_are_all, load_hf
from pooling_models import PAD, st_reference, write_bidirectional_gemma3, write_dense, write_qwen2_classifier

from coreserve import LLM, PoolingParams, SamplingParams
from coreserve.worker.pooling.st_modules import read_st_modules

# token ids (the llama2 vocabulary): lengths 1 to 40, some ending in pads (HF's classifier skips them)
PROMPTS = [[1, 450, 7483, 310, 3444, 338], [1, *range(300, 339)], [1, 22172, 29892, PAD, PAD], [PAD, PAD], [1],
           [1, 512, 513, 514, 515, 516, 517, 518, 519, 520, 521, 522]]


def ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = write_qwen2_classifier(tmp_path_factory.mktemp("cls"), 3)
    with LLM(path, multiprocess=False, num_kv_blocks=64, max_num_batched_tokens=32) as llm:
        yield path, llm


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = write_bidirectional_gemma3(tmp_path_factory.mktemp("gemma"), sliding_window=8)
    with LLM(path, multiprocess=False, num_kv_blocks=64, max_num_batched_tokens=16) as llm:
        yield path, llm


@pytest.mark.fp32_exact("HF's reference is fp32")
def test_a_causal_lm_embeds_as_hfs_normalized_last_hidden_state(tiny_path):
    prompts = PROMPTS[:2] + PROMPTS[4:]
    hf = load_hf(tiny_path)
    with LLM(tiny_path, multiprocess=False, runner="pooling", num_kv_blocks=64) as llm:
        assert llm.facts.runner == "pooling" and llm.facts.pooling.tasks == ["embed"]
        batch = llm.embed(ids(prompts), use_tqdm=False)
        raw = llm.embed(ids(prompts[:1]), use_tqdm=False, pooling_params=PoolingParams(normalize=False))[0]
        for prompt, out in zip(prompts, batch):
            with torch.no_grad():
                last = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
            got = np.asarray(out.outputs.embedding, dtype=np.float32)
            assert np.abs(got - torch.nn.functional.normalize(last, dim=0).numpy()).max() < 1e-5
            assert got.tolist() == llm.embed(ids([prompt]), use_tqdm=False)[0].outputs.embedding
        with torch.no_grad():
            last = hf(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states[-1][0, -1]
        assert np.abs(np.asarray(raw.outputs.embedding) - last.numpy()).max() < 1e-4
        assert free_blocks_are_all(llm)


def test_a_qwen2_classifier_is_hfs_logits_at_the_last_non_pad_token(classifier):
    path, llm = classifier
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    probs = llm.classify(ids(PROMPTS), use_tqdm=False)
    logits = llm.classify(ids(PROMPTS), use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    for prompt, prob, logit in zip(PROMPTS, probs, logits):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        assert prob.outputs.num_classes == 3
        assert np.abs(np.asarray(logit.outputs.probs) - expected.numpy()).max() < 1e-4
        assert np.abs(np.asarray(prob.outputs.probs) - expected.softmax(-1).numpy()).max() < 1e-5
        alone = llm.classify(ids([prompt]), use_tqdm=False)[0]
        assert alone.outputs.probs == prob.outputs.probs  # the same bits alone and batched
    assert llm.facts.pooling.labels == ["LABEL_0", "LABEL_1", "LABEL_2"]
    assert free_blocks_are_all(llm)


def test_a_reward_models_one_label_head_is_hfs_score(tmp_path):
    path = write_qwen2_classifier(tmp_path / "rm", 1)
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(path, multiprocess=False, num_kv_blocks=64) as llm:
        rewards = llm.reward(ids(PROMPTS[:3]), use_tqdm=False)
        sigmoid = llm.classify(ids(PROMPTS[:1]), use_tqdm=False)[0]
        for prompt, reward in zip(PROMPTS, rewards):
            with torch.no_grad():
                expected = hf(torch.tensor([prompt])).logits[0]
            assert reward.outputs.data.shape == (1,) and abs(reward.outputs.data[0] - expected[0].item()) < 1e-4
            assert llm.reward(ids([prompt]), use_tqdm=False)[0].outputs.data.tobytes() == reward.outputs.data.tobytes()
        assert abs(sigmoid.outputs.probs[0] - torch.sigmoid(torch.tensor(rewards[0].outputs.data[0])).item()) < 1e-6


def test_a_bidirectional_gemma3_with_dense_layers_is_sentence_transformers(gemma):
    """Prompts past the sliding layer's window (8: keys within 4 either side) and past the step budget of 16
    (a pooling engine's budget is max_model_len at least: each prompt in one step)."""
    path, llm = gemma
    assert llm.facts.pooling.output_size == 48
    batch = llm.embed(ids(PROMPTS), use_tqdm=False)
    for prompt, out in zip(PROMPTS, batch):
        expected = st_reference(path, prompt).numpy()
        got = np.asarray(out.outputs.embedding, dtype=np.float32)
        assert abs(np.linalg.norm(got) - 1) < 1e-6 and np.abs(got - expected).max() < 1e-5
        assert llm.embed(ids([prompt]), use_tqdm=False)[0].outputs.embedding == out.outputs.embedding
    assert free_blocks_are_all(llm)


def test_score_is_the_cosine_of_the_two_embeddings(gemma):
    _, llm = gemma
    texts = ["The capital of France is Paris.", "Paris", "a cat"]
    embeddings = [np.asarray(o.outputs.embedding, dtype=np.float64) for o in llm.embed(texts, use_tqdm=False)]
    scores = llm.score(texts[0], texts[1:], use_tqdm=False)
    assert [s.outputs.score for s in scores] == pytest.approx([embeddings[0] @ e for e in embeddings[1:]], abs=1e-6)
    pairwise = llm.score(texts[:2], texts[1:], use_tqdm=False)
    assert pairwise[0].outputs.score == pytest.approx(embeddings[0] @ embeddings[1], abs=1e-6)


def test_what_a_pooling_engine_does_not_do_is_refused_by_name(classifier, gemma):
    _, cls = classifier
    _, emb = gemma
    with pytest.raises(ValueError, match="runner='pooling'.*generates nothing"):
        cls.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="task 'embed' is not this model's"):
        cls.embed(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=16: .* 48 values"):
        emb.embed(["hello"], use_tqdm=False, pooling_params=PoolingParams(dimensions=16))
    with pytest.raises(ValueError, match="logprobs does not apply to a pooling request"):
        params = SamplingParams(max_tokens=1, logprobs=2, pooling=PoolingParams(task="embed"))
        emb.generate(["hello"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_task='token_embed'.* not built"):
        emb.encode(["hello"], pooling_task="token_embed", use_tqdm=False)
    with pytest.raises(ValueError, match="this classifier has 3 labels"):
        cls.score("a", ["b"], use_tqdm=False)
    with pytest.raises(ValueError, match="normalize and use_activation disagree"):
        PoolingParams(normalize=True, use_activation=False)


def test_a_generation_engine_refuses_pooling_and_a_pooling_model_refuses_generate(llm_inproc, gemma, tmp_path):
    with pytest.raises(ValueError, match="needs an engine started with runner='pooling'"):
        llm_inproc.embed(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="need an engine with runner='pooling'"):
        llm_inproc.score("a", ["b"], use_tqdm=False)
    params = SamplingParams(max_tokens=1, pooling=PoolingParams(task="embed"))
    with pytest.raises(ValueError, match="needs an engine started with runner='pooling'"):
        llm_inproc.generate(["hello"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="use_bidirectional_attention=true .* runner='pooling' only"):
        LLM(gemma[0], multiprocess=False, runner="generate", num_kv_blocks=16)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda f: _edit(f / "1_Pooling" / "config.json", pooling_mode_max_tokens=True), "pooling_mode_max_tokens is not built"),
        (lambda f: _edit(f / "modules.json", **{"2": "../elsewhere"}), "leaves the model's folder"),
        (lambda f: write_dense(f / "3_Dense", 64, 48, False, "torch.nn.modules.linear.Identity"), "in_features=64"),
        (lambda f: write_dense(f / "3_Dense", 96, 48, False, "torch.nn.modules.activation.GELU"), "GELU.* not built"),
        (lambda f: _edit(f / "modules.json", type_4="sentence_transformers.models.LayerNorm"), "LayerNorm.* not built"),
    ],
)
def test_a_sentence_transformers_folder_is_checked_before_it_is_read(gemma, tmp_path, change, refusal):
    folder = tmp_path / "copy"
    shutil.copytree(gemma[0], folder)
    change(folder)
    with pytest.raises(ValueError, match=refusal):
        read_st_modules(folder, 64)


def _edit(path, **changes) -> None:
    """A JSON file with keys changed; modules.json: "N" sets module N's path, "type_N" its type."""
    value = json.loads(path.read_text())
    for key, new in changes.items():
        if isinstance(value, list):
            field, index = ("type", key[5:]) if key.startswith("type_") else ("path", key)
            value[int(index)][field] = new
        else:
            value[key] = new
    path.write_text(json.dumps(value))


@pytest.mark.parametrize(("pooling_type", "refusal"), [(1, None), (0, "pooling_type 0, none"), (4, "rank")])
def test_a_gguf_files_pooling_type_is_read_and_the_kinds_not_built_refused(tmp_path, monkeypatch, pooling_type,
                                                                           refusal):
    """llama.cpp's `<arch>.pooling_type`: 1 (mean) makes the engine a pooling one by itself (runner "auto"),
    its vector HF's mean of the final hidden states (of the file's values), normalized; 0 (none) and 4
    (rank) are refused by name."""
    import gguf_files
    from transformers import LlamaConfig, LlamaForCausalLM

    written = gguf_files._write_metadata

    def with_pooling(writer, vocab_size: int) -> None:
        written(writer, vocab_size)
        writer.add_uint32("llama.pooling_type", pooling_type)

    monkeypatch.setattr(gguf_files, "_write_metadata", with_pooling)
    path = tmp_path / "model.gguf"
    expected = gguf_files.write_gguf_model(path, {}, vocab_size=512)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            LLM(str(path), multiprocess=False, num_kv_blocks=16)
        return
    prompt = [5, 6, 7, 8, 9]
    with LLM(str(path), multiprocess=False, num_kv_blocks=16) as llm:
        got = np.asarray(llm.embed(ids([prompt]), use_tqdm=False)[0].outputs.embedding)
        assert llm.facts.runner == "pooling"
    config = {**gguf_files.make_config(gguf_files.SPEC), "vocab_size": 512,
              "rms_norm_eps": float(np.float32(gguf_files.SPEC.rms_norm_eps))}
    hf = LlamaForCausalLM(LlamaConfig(**config)).eval()
    hf.load_state_dict({name: torch.from_numpy(values) for name, values in expected.items()}, strict=False)
    with torch.no_grad():
        rows = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    assert np.abs(got - torch.nn.functional.normalize(rows.mean(dim=0), dim=0).numpy()).max() < 1e-5
