"""Shared factories: the built-in model, a Qwen2-style model, Hugging Face references, engines."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from frontend.builtin_model import ModelSpec, builtin_model_path, ensure_model  # noqa: E402

QWEN_SPEC = ModelSpec(
    architecture="qwen2",
    num_layers=3,
    hidden_size=192,
    num_heads=6,
    num_kv_heads=3,
    intermediate_size=512,
    seed=7,
)

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "In a hole in the ground there lived a hobbit.",
    "1 2 3 4 5 6 7 8",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time",
    "Pack my box with five dozen liquor jugs, said the",
    "a",
    "Les sanglots longs des violons de l'automne blessent mon coeur",
    "日本語のテキストも",
    "SELECT * FROM users WHERE",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief",
    "Q: What is 2 + 2?\nA:",
    "<html><body>",
    "import numpy as np\nimport torch\n\n",
    "The mitochondria is the powerhouse",
]


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return builtin_model_path("tiny")


@pytest.fixture(scope="session")
def qwen_path() -> str:
    return ensure_model(QWEN_SPEC, Path.home() / ".cache" / "coreserve" / "test-qwen2-v1")


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from frontend.engine_args import load_tokenizer

    return load_tokenizer(tiny_path)


def load_hf(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tiny(tiny_path):
    return load_hf(tiny_path)


def hf_logprobs(model, token_ids: list[int]):
    """[len(token_ids), vocab] float64 log_softmax of HF's logits at every position."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.fixture(scope="session")
def llm_inproc(tiny_path):
    from frontend import LLM

    llm = LLM(tiny_path, multiprocess=False, max_num_batched_tokens=256, num_kv_blocks=512)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def llm_mp(tiny_path):
    from frontend import LLM

    llm = LLM(tiny_path, max_num_batched_tokens=256, num_kv_blocks=512)
    yield llm
    llm.shutdown()


def copy_model_with_eos(src: str, dst: Path, eos_token_id: int) -> str:
    """The same weights and tokenizer with another EOS id, so a test can make EOS likely."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in Path(src).iterdir():
        if item.name != "config.json":
            target = dst / item.name
            if not target.exists():
                os.symlink(item, target)
    config = json.loads((Path(src) / "config.json").read_text())
    config["eos_token_id"] = eos_token_id
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


async def stream_then_abort(engine, params, request_id: str, after: int = 2) -> list:
    """Streams PROMPTS[0] and aborts the request once `after` deltas have arrived; returns every delta."""
    outputs = []
    async for out in engine.generate(PROMPTS[0], params, request_id):
        outputs.append(out)
        if len(outputs) == after:
            await engine.abort(request_id)
    return outputs


def free_blocks_are_all(llm) -> bool:
    """Idle and every KV block free, as the core reports it (in process or across the socket)."""
    stats = llm.get_engine_stats()
    return stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0
