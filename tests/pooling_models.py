"""Random pooling models for the pooling tests (tests/test_pooling.py, tests/test_server_pooling.py): HF's own
classes on tiny configs with the llama2 tokenizer, saved as folders the engine and transformers both load. A
bidirectional Gemma 3 is written as a sentence-transformers folder (modules.json, 1_Pooling, two Dense
layers, Normalize), as EmbeddingGemma is."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from gguf_fuzz_files import peaked_init
from real_tokenizers import real_tokenizer_path

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
PAD = 0  # the llama2 tokenizer's <unk>: a pad id the tests put at prompts' ends


def _save(model, folder: Path) -> str:
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(peaked_init(name, param))
    model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(real_tokenizer_path("llama2")).save_pretrained(str(folder))
    return str(folder)


def write_qwen2_classifier(folder: Path, num_labels: int, **extra) -> str:
    """A random Qwen2ForSequenceClassification (`num_labels` 1: a reward model's head)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    labels = {} if "id2label" in extra else {"num_labels": num_labels}
    config = Qwen2Config(**SMALL, vocab_size=32000, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, **labels,
                         **extra)
    torch.manual_seed(0)
    return _save(Qwen2ForSequenceClassification(config), folder)


def write_bidirectional_gemma3(folder: Path, sliding_window: int = 8) -> str:
    """A random bidirectional Gemma3TextModel (a sliding and a full layer) with sentence-transformers
    modules: mean pooling, Dense 64 -> 96 (tanh, bias), Dense 96 -> 48 (no bias), Normalize."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    config = Gemma3TextConfig(**{**SMALL, "num_key_value_heads": 1}, vocab_size=32000, head_dim=32,
                              sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
                              use_bidirectional_attention=True, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
                              query_pre_attn_scalar=32)
    torch.manual_seed(0)
    _save(Gemma3TextModel(config), folder)
    modules = [("0", "", "Transformer"), ("1", "1_Pooling", "Pooling"), ("2", "2_Dense", "Dense"),
               ("3", "3_Dense", "Dense"), ("4", "4_Normalize", "Normalize")]
    _json(folder / "modules.json", [{"idx": i, "name": n, "path": p, "type": f"sentence_transformers.models.{t}"}
                                    for i, (n, p, t) in enumerate(modules)])
    _json(folder / "1_Pooling" / "config.json", {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
                                                 "pooling_mode_cls_token": False, "include_prompt": True})
    write_dense(folder / "2_Dense", 64, 96, True, "torch.nn.modules.activation.Tanh")
    write_dense(folder / "3_Dense", 96, 48, False, "torch.nn.modules.linear.Identity")
    return str(folder)


def write_dense(folder: Path, num_in: int, num_out: int, has_bias: bool, activation: str) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(num_in * num_out)
    tensors = {"linear.weight": torch.randn(num_out, num_in, generator=generator) * num_in**-0.5}
    if has_bias:
        tensors["linear.bias"] = 0.1 * torch.randn(num_out, generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    _json(folder / "config.json", {"in_features": num_in, "out_features": num_out, "bias": has_bias,
                                   "activation_function": activation})


def st_reference(folder: str, token_ids: list[int]) -> torch.Tensor:
    """What sentence-transformers computes for the folder above, in torch from HF's Gemma3TextModel: the
    mean of the last hidden states, the Dense layers, the L2 norm."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        x = model(torch.tensor([token_ids])).last_hidden_state[0].mean(dim=0)
        for name, activation in (("2_Dense", torch.tanh), ("3_Dense", None)):
            tensors = load_file(str(Path(folder) / name / "model.safetensors"))
            x = torch.nn.functional.linear(x, tensors["linear.weight"], tensors.get("linear.bias"))
            x = activation(x) if activation is not None else x
    return torch.nn.functional.normalize(x, dim=0)


def _json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))
