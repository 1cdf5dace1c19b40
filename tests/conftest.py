"""Shared factories: the built-in model, a Qwen2-style model, Hugging Face references, engines."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from gguf_fuzz_files import peaked_init  # noqa: E402  (the family models' init, the fuzzer's too)
from real_tokenizers import real_tokenizer_path  # noqa: E402  (tests/: the family tests' tokenizers)

from coreserve.protocol.builtin_model import (  # noqa: E402
    ModelSpec,
    builtin_model_path,
    default_cache_dir,
    ensure_model,
)

# The suite's weight dtype: `CORESERVE_TEST_DTYPE=bfloat16` (`make test-bf16`) hands every engine the tests
# build a bf16 copy of the same checkpoint (the engine's dtype "auto" takes the checkpoint's), so in
# process, daemon and server alike run bf16 weights without any test naming a dtype. Read here only.
TEST_DTYPE = os.environ.get("CORESERVE_TEST_DTYPE", "float32")
if TEST_DTYPE not in ("float32", "bfloat16"):
    raise ValueError(f"CORESERVE_TEST_DTYPE={TEST_DTYPE!r}: use float32 (the default) or bfloat16")
IS_BF16_MODE = TEST_DTYPE == "bfloat16"
# |logprob| against HF in fp32 on the same weights (HF widens bf16 weights to fp32). With bf16 weights the
# C kernels round each product's activations to bf16: worst measured 0.094 (qwen3 prompt logprobs; tiny
# 0.057, qwen 0.063). The torch path (can_use_cpu_kernels=False, the CUDA one) keeps bf16 activations and
# a bf16 KV cache throughout: worst measured 0.28 (tiny), 0.13 (mistral). docs/testing.md has the table.
HF_TOLERANCE = 0.15 if IS_BF16_MODE else 1e-4
HF_TOLERANCE_TORCH_PATH = 0.4 if IS_BF16_MODE else 1e-4
# Same weights, another batch shape (prefill chunks, multi-step windows that keep stopped rows, a warm
# prefix cache): a row's products round with the number of rows (~1e-7 in fp32), and with bf16 weights
# the kernels round each product's activations to bf16, which lifts that to ~1e-2 in a logprob (measured
# 0.026); near-ties among the listed candidates may then swap. None: each test's own fp32 tolerance.
BATCH_SHAPE_TOLERANCE = 0.05 if IS_BF16_MODE else None

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


def pytest_report_header(config) -> str:
    return f"coreserve test weights: {TEST_DTYPE} (CORESERVE_TEST_DTYPE)"


def pytest_collection_modifyitems(config, items) -> None:
    if not IS_BF16_MODE:
        return
    for item in items:
        marker = item.get_closest_marker("fp32_exact")
        if marker is not None:
            reason = marker.args[0] if marker.args else "holds in fp32 only"
            item.add_marker(pytest.mark.skip(reason=f"fp32_exact: {reason}"))


PEAK_RSS_LIMIT_MIB = 4096  # issue 49: a host with a memory limit runs the suite; engines give memory back


@pytest.fixture(autouse=True, scope="module")
def _heap_given_back_after_each_module():
    """After each test module, the C heap's free pages go back to the OS (glibc's malloc_trim, as an idle
    core does: coreserve/engine_core/server.py), so that the peak RSS below measures what tests hold, not
    the free pages earlier modules left scattered through the heap."""
    yield
    import ctypes
    import gc

    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pytest_sessionfinish(session, exitstatus) -> None:
    """Past PEAK_RSS_LIMIT_MIB the run fails: something keeps closed engines' memory."""
    limit = int(os.environ.get("CORESERVE_PEAK_RSS_LIMIT_MIB", PEAK_RSS_LIMIT_MIB))
    if _peak_rss_mib() > limit and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    """The pytest process's peak resident memory over the suite (spawned cores and the conformance
    script's processes are their own)."""
    limit = int(os.environ.get("CORESERVE_PEAK_RSS_LIMIT_MIB", PEAK_RSS_LIMIT_MIB))
    over = " FAILED: past the limit" if _peak_rss_mib() > limit else ""
    terminalreporter.write_line(f"pytest process peak RSS: {_peak_rss_mib():.0f} MiB (limit {limit}){over}")


def in_test_dtype(path: str) -> str:
    """`path` itself in fp32 mode; in bf16 mode its bf16 copy, made once next to it (the same
    tokenizer and config, the weights rounded to bf16, config.json naming bfloat16)."""
    if not IS_BF16_MODE:
        return path
    source = Path(path)
    copy = source.with_name(source.name + "-bf16")
    if not (copy / "config.json").exists():
        _write_bf16_copy(source, copy)
    return str(copy)


def _write_bf16_copy(source: Path, copy: Path) -> None:
    import shutil
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    tmp = Path(tempfile.mkdtemp(prefix=copy.name + ".", dir=copy.parent))
    try:
        for item in source.iterdir():
            if item.suffix == ".safetensors":
                tensors = {n: t.to(torch.bfloat16) for n, t in load_file(str(item)).items()}
                save_file(tensors, str(tmp / item.name), metadata={"format": "pt"})
            elif item.name == "config.json":
                config = json.loads(item.read_text())
                config.update(torch_dtype="bfloat16", dtype="bfloat16")
                (tmp / item.name).write_text(json.dumps(config, indent=2))
            elif item.is_file():
                shutil.copy(item, tmp / item.name)
        os.rename(tmp, copy)  # whole or not at all; a session that lost the race finds the winner's
    except OSError:
        if not (copy / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def kernels():
    """The CPU kernels built for this machine (modules with their own `kernels` fixture use theirs)."""
    from coreserve.worker.cpu.kernels import load_cpu_kernels

    loaded = load_cpu_kernels()
    assert loaded is not None, "this machine has a C compiler: the kernels must build"
    return loaded


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return in_test_dtype(builtin_model_path("tiny"))


@pytest.fixture(scope="session")
def qwen_path() -> str:
    return in_test_dtype(ensure_model(QWEN_SPEC, Path.home() / ".cache" / "coreserve" / "test-qwen2-v1"))


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from coreserve.frontend.engine.engine_args import load_tokenizer

    return load_tokenizer(tiny_path)


def load_hf(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tiny(tiny_path):
    return load_hf(tiny_path)


def hf_logprobs(model, token_ids: list[int]):
    """[len(token_ids), vocab] float64 log_softmax of HF's logits at every position, on one torch thread
    (hf_reference.one_torch_thread: on the shared 2-core host a small model's ops wait for the second)."""
    import torch
    from hf_reference import one_torch_thread

    with torch.no_grad(), one_torch_thread():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.fixture(scope="session")
def llm_inproc(tiny_path):
    from coreserve import LLM

    llm = LLM(tiny_path, multiprocess=False, max_num_batched_tokens=256, num_kv_blocks=512)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def llm_mp(tiny_path):
    from coreserve import LLM

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


ROOT = Path(__file__).resolve().parent.parent


def start_daemon(model: str, address: str, *flags: str, timeout_s: float = 120.0):
    """`python -m coreserve.engine_core` on `address`, returned once it listens (its ipc socket file exists)."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "coreserve.engine_core", "--model", model, "--address", address, *flags],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    path = address[len("ipc://") :] + ".in"
    deadline = time.monotonic() + timeout_s
    while address.startswith("ipc://") and not os.path.exists(path):
        assert proc.poll() is None, f"the daemon exited with code {proc.returncode}"
        assert time.monotonic() < deadline, "the daemon did not start listening"
        time.sleep(0.1)
    return proc


@contextlib.contextmanager
def running_daemon(model: str, address: str, *flags: str):
    """start_daemon for a `with` block: SIGTERM at its end, and the daemon must exit cleanly (0)."""
    proc = start_daemon(model, address, "--num-kv-blocks", "256", *flags)
    try:
        yield proc
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def run_daemon_command(*args: str, timeout: float = 120):
    """`python -m coreserve.engine_core ARGS` to its end (a command-line mistake, keygen): its CompletedProcess."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "coreserve.engine_core", *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_same_positions(got: list[dict], expected: list[dict], fp32_tolerance: float) -> None:
    """Logprob positions of one request from two runs on the same weights: in fp32 the same tokens in the
    same order with the same ranks, values within `fp32_tolerance`. In bf16 mode values within
    BATCH_SHAPE_TOLERANCE, the sampled token the same, and a token listed or ranked differently only
    where it lies within that tolerance of another listed candidate (a near-tie the rounding swapped)."""
    tolerance = BATCH_SHAPE_TOLERANCE or fp32_tolerance
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        for token_id in a.keys() & b.keys():
            assert abs(a[token_id].logprob - b[token_id].logprob) <= tolerance, (token_id, a, b)
        if not IS_BF16_MODE or [(t, v.rank) for t, v in a.items()] == [(t, v.rank) for t, v in b.items()]:
            assert [(t, v.rank) for t, v in a.items()] == [(t, v.rank) for t, v in b.items()]
            continue
        assert next(iter(a)) == next(iter(b))
        values = {t: v.logprob for t, v in (*b.items(), *a.items())}
        moved = [t for t in a.keys() | b.keys() if t not in a or t not in b or a[t].rank != b[t].rank]
        for token_id in moved:
            near = [t for t in values if t != token_id and abs(values[t] - values[token_id]) <= tolerance]
            assert near or _is_a_tail_neighbour(a.get(token_id), b.get(token_id)), (token_id, a, b)


def _is_a_tail_neighbour(a, b) -> bool:
    """Deep in the tail (rank > 1000) candidates lie closer than the rounding: a rank may move by 1%."""
    return (
        a is not None
        and b is not None
        and min(a.rank, b.rank) > 1000
        and abs(a.rank - b.rank) <= max(2, min(a.rank, b.rank) // 100)
    )


def assert_same_greedy_tokens(got, expected) -> None:
    """Two greedy completions of one prompt (CompletionOutputs with logprobs >= 1) from runs of other batch
    shapes: the same tokens. In bf16 mode they may part at a near-tie, where each run's listing puts the
    two chosen tokens within BATCH_SHAPE_TOLERANCE of each other; after that the prefixes differ."""
    part = next((i for i, (a, b) in enumerate(zip(got.token_ids, expected.token_ids)) if a != b), None)
    if part is None or not IS_BF16_MODE:
        assert got.token_ids == expected.token_ids
        return
    ours, theirs = got.token_ids[part], expected.token_ids[part]
    for entry in (got.logprobs[part], expected.logprobs[part]):
        assert ours in entry and theirs in entry, (part, entry)
        assert abs(entry[ours].logprob - entry[theirs].logprob) <= BATCH_SHAPE_TOLERANCE, (part, entry)


def free_blocks_are_all(llm) -> bool:
    """Idle and every KV block free, as the core reports it (in process or across the socket)."""
    stats = llm.get_engine_stats()
    return stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0


# Real model families, scaled down: random weights in a config shaped like each family's (its RoPE
# scaling, window, norms, tying), with a real tokenizer; RoPE thresholds and windows scaled down so
# that test prompts cross them. Each maker returns a Hugging Face folder that transformers loads too.
# The tokenizers are made by tests/real_tokenizers.py from files scripts/setup.sh fetches.
_SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    hidden_act="silu",
)
def _longrope_phi(num_factors: int, **rope) -> dict:
    """A Phi-3 config with LongRoPE, its original_max_position_embeddings scaled down to 32."""
    factors = dict(
        short_factor=[1.0 + 0.05 * i for i in range(num_factors)],
        long_factor=[1.5 + 0.75 * i for i in range(num_factors)],
    )
    return dict(
        model_type="phi3", tokenizer="llama2", pad_token_id=0, original_max_position_embeddings=32,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, **rope, **factors),
    )


FAMILY_CONFIGS = {
    "llama2": dict(model_type="llama", tokenizer="llama2", rope_theta=10000.0, tie_word_embeddings=False),
    "llama3.1": dict(
        model_type="llama",
        tokenizer="llama3",
        tie_word_embeddings=False,
        attention_bias=True,  # not Llama 3.1's own: covers the q/k/v/o biases some Llama checkpoints have
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "llama3.2": dict(
        model_type="llama",
        tokenizer="llama3",
        tie_word_embeddings=True,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "mistral": dict(model_type="mistral", tokenizer="llama2", rope_theta=10000.0, sliding_window=24),
    "qwen2": dict(
        model_type="qwen2",
        tokenizer="llama3",
        tie_word_embeddings=True,
        padded_vocab=128 * 1024 + 512,  # Qwen pads its embedding past the tokenizer
        rope_parameters=dict(
            rope_type="yarn", rope_theta=1000000.0, factor=8.0, original_max_position_embeddings=32
        ),
    ),
    "qwen3": dict(
        model_type="qwen3",
        tokenizer="llama3",
        tie_word_embeddings=True,
        head_dim=32,  # explicit: heads x head_dim (128) is not the hidden size (64)
        padded_vocab=128 * 1024 + 512,
        rope_parameters=dict(rope_type="linear", rope_theta=1000000.0, factor=2.0),
    ),
    # Phi-3-mini-4k's shape: fused qkv_proj and gate_up_proj tensors, a sliding window (2047 there)
    "phi3": dict(model_type="phi3", tokenizer="llama2", rope_theta=10000.0, sliding_window=24, pad_token_id=0),
    # Phi-3.5-mini's LongRoPE (its 4096 scaled to 32; factors per frequency of a 16-wide head)
    "phi3.5": _longrope_phi(8),
    # Phi-4-mini's partial rotary (3/4 of each 16-wide head) under LongRoPE (6 factors: rotary width / 2)
    "phi4-mini": _longrope_phi(6, partial_rotary_factor=0.75),
    # Gemma 2: alternating local (window 24) and global layers, both soft-caps, query_pre_attn_scalar
    # other than head_dim (Gemma 2 27B's case), tied embeddings
    "gemma2": dict(
        model_type="gemma2", tokenizer="llama2", head_dim=32, sliding_window=24, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=8.0, pad_token_id=0,
    ),
    # Gemma 3 (text): q/k norms, local layers (window 24) with their own RoPE base, a global layer with
    # linear scaling, no soft-caps
    "gemma3": dict(
        model_type="gemma3_text", tokenizer="llama2", head_dim=32, sliding_window=24, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
        },
    ),
    # Gemma 4 (text): a local layer (window 24, default RoPE) and a global one whose proportional RoPE turns a
    # quarter of the frequencies of each head, norms scaling by weight, an unscaled norm on v, a final soft-cap;
    # no per-layer embeddings (HF's default 256), global_head_dim = head_dim (HF's default 512 is refused)
    "gemma4": dict(
        model_type="gemma4_text", tokenizer="llama2", head_dim=32, global_head_dim=32, sliding_window=24,
        pad_token_id=0, hidden_size_per_layer_input=0, final_logit_softcapping=8.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            "full_attention": dict(rope_type="proportional", rope_theta=1000000.0, partial_rotary_factor=0.25),
        },
    ),
    # Mixtures of experts, 8 experts, 2 a token. Qwen3-MoE: its q/k head norms, renormalised top-k,
    # layer 1 a dense MLP (mlp_only_layers), experts narrower than the dense MLP
    "qwen3_moe": dict(
        model_type="qwen3_moe", tokenizer="llama2", head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1000000.0,
    ),
    # Mixtral: top-k always renormalised, Mistral's window
    "mixtral": dict(
        model_type="mixtral", tokenizer="llama2", num_local_experts=8, num_experts_per_tok=2,
        sliding_window=24, rope_theta=1000000.0,
    ),
    # Qwen3.5 (dense): a Gated DeltaNet layer (2 key heads serving 4 value heads, conv kernel 4), then an
    # output-gated attention layer rotating a quarter of each head, norms scaling by 1 + weight
    "qwen3_5": dict(
        model_type="qwen3_5_text", tokenizer="llama3", head_dim=32, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
    # Qwen3-Next: Qwen3.5's layers (its q/k/v/z and b/a projections interleaved a key head's group at a time
    # in the checkpoint) with a mixture of 8 experts, 2 a token, and a sigmoid-gated shared expert
    "qwen3_next": dict(
        model_type="qwen3_next", tokenizer="llama3", head_dim=32, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
    # LFM2: a gated short convolution layer (kernel 3), then attention with per-head q/k norms; the MLP's
    # width auto-adjusted (2/3 of 128, rounded up to 32: 96), tied embeddings
    "lfm2": dict(
        model_type="lfm2", tokenizer="llama3", layer_types=["conv", "full_attention"], conv_L_cache=3,
        block_multiple_of=32, norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # Granite 4.0-H (dense): a Mamba2 layer (4 heads of 16 in 2 groups, d_state 16, conv kernel 4), then NoPE
    # attention on heads of 32; a shared_mlp of 96 (not intermediate_size); the four multipliers
    "granitemoehybrid": dict(
        model_type="granitemoehybrid", tokenizer="llama3", num_attention_heads=2, layer_types=["mamba", "attention"],
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1,
        num_local_experts=0, shared_intermediate_size=96, position_embedding_type="nope",
        embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.09, logits_scaling=1.6,
    ),
    # OLMoE: q/k norms over the whole projections, clip_qkv, top-k probabilities as they are
    "olmoe": dict(
        model_type="olmoe", tokenizer="llama2", num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        clip_qkv=2.0, pad_token_id=0,
    ),
    # OLMo 2: norms on attention's and the MLP's outputs only, q/k norms over the whole projections
    "olmo2": dict(
        model_type="olmo2", tokenizer="llama3", rope_parameters=dict(rope_type="default", rope_theta=500000.0),
    ),
    # OLMo 3: OLMo 2's layers, a sliding one (window 24, its own default RoPE) then a global one under YaRN
    "olmo3": dict(
        model_type="olmo3", tokenizer="llama3", sliding_window=24, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            "full_attention": dict(
                rope_type="yarn", rope_theta=500000.0, factor=8.0, original_max_position_embeddings=32,
            ),
        },
    ),
    # SmolLM3: four layers, the fourth without RoPE (HF's no_rope_layers default, llama.cpp's fixed rule), tied
    "smollm3": dict(model_type="smollm3", tokenizer="llama3", num_hidden_layers=4),
    # Exaone 4: norms on the outputs only, per-head q/k norms; a local layer (window 24, RoPE), a global one (NoPE)
    "exaone4": dict(
        model_type="exaone4", tokenizer="llama3", head_dim=32, sliding_window=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # gpt-oss: a sliding layer (window 8) then a full one, each softmax with a learned sink a head, YaRN, q/k/v/o
    # biases; 4 experts (top 2) with biases, gate and up interleaved, the clamped SwiGLU (limit 1.5, not 7: crossed)
    "gpt_oss": dict(
        model_type="gpt_oss", tokenizer="llama2", head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=1.5, attention_bias=True,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=32,
        ),
    ),
}


def write_family_model(
    folder: Path, family: str, dtype: str = "float32", max_shard_size: str | None = None, seed: int = 0
) -> str:
    """Makes a random-weight checkpoint of `family` with its real tokenizer; peaked next-token
    distributions (logit std of several units) so greedy argmax is never a near-tie."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = dict(FAMILY_CONFIGS[family])
    tokenizer = AutoTokenizer.from_pretrained(real_tokenizer_path(spec.pop("tokenizer")))
    vocab = spec.pop("padded_vocab", None) or -(-len(tokenizer) // 64) * 64
    config = AutoConfig.for_model(
        **{**_SMALL, **spec}, vocab_size=vocab, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(peaked_init(name, param))
        for name, buffer in model.named_buffers():  # Gemma 4's, a tensor of its checkpoint: not 1, so it is read
            if name.endswith("layer_scalar"):
                buffer.fill_(0.75 + 0.5 * torch.rand(()).item())
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(getattr(torch, dtype)).save_pretrained(str(folder), **kwargs)
    tokenizer.save_pretrained(str(folder))
    return str(folder)


# transformers' Mxfp4Config as the hub's gpt-oss folders carry it in config.json
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def write_mxfp4_experts(folder: Path, seed: int = 0, scales: tuple[int, int] = (118, 126)) -> str:
    """A gpt_oss folder's float experts (one model.safetensors) replaced by random MXFP4 ones as the hub's
    checkpoints hold them: `mlp.experts.{gate_up,down}_proj_blocks` [E, out, in / 32, 16] uint8 (two elements
    a byte, the even one in the low nibble) and `_scales` [E, out, in / 32] uint8 (e8m0, 2^(e - 127), e drawn
    from `scales`), rows in the float tensors' output order (gate_up's gate and up interleaved); config.json's
    quantization_config as transformers writes it."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(seed)
    weights = folder / "model.safetensors"
    tensors = {}
    for name, tensor in load_file(str(weights)).items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name] = tensor
            continue
        experts, num_in, num_out = tensor.shape  # HF's [E, in, out]
        shape = (experts, num_out, num_in // 32)
        tensors[name + "_blocks"] = torch.from_numpy(rng.integers(0, 256, (*shape, 16), dtype=np.uint8))
        tensors[name + "_scales"] = torch.from_numpy(rng.integers(*scales, shape, dtype=np.uint8))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}, indent=2))
    return str(folder)


@pytest.fixture(scope="session")
def family_model():
    """family_model(name) -> folder of that family's test model in TEST_DTYPE (cached_family_model)."""
    made: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in made:
            made[family] = cached_family_model(family, TEST_DTYPE)
        return made[family]

    return make


def cached_family_model(family: str, dtype: str) -> str:
    """write_family_model's folder of `family`, kept in ~/.cache/coreserve/family-models/ (read only: tests
    copy or link what they change) under a digest of everything that makes it: the bytes of this file and
    of the modules it draws the weights and tokenizers with, the tokenizer's files, torch's and
    transformers' versions. Any change makes another folder; an unchanged one is not made again (the 24
    families took 20-30 s a session)."""
    import hashlib
    import shutil

    import torch
    import transformers

    tests = Path(__file__).parent
    digest = hashlib.sha256(f"{family}:{dtype}:{torch.__version__}:{transformers.__version__}".encode())
    tokenizer = Path(real_tokenizer_path(FAMILY_CONFIGS[family]["tokenizer"]))
    for path in [tests / "conftest.py", tests / "gguf_fuzz_files.py", tests / "real_tokenizers.py",
                 *sorted(tokenizer.iterdir())]:
        digest.update(path.name.encode() + path.read_bytes())
    folder = default_cache_dir() / "family-models" / f"{family}-{dtype}-{digest.hexdigest()[:16]}"
    if not (folder / "config.json").exists():
        tmp = folder.with_name(f"{folder.name}.{os.getpid()}")
        write_family_model(tmp, family, dtype=dtype)
        try:
            os.rename(tmp, folder)
        except OSError:  # another session's copy landed first: either will do
            shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


FAMILY_PROMPTS_SHORT = ["The capital of France is", "日本語のテキスト 🎉 and code: def f(x): return x"]


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the module's `server` fixture (a base URL)."""
    import openai
    from server_harness import API_KEY

    with openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def http(server):
    """An httpx client on the module's `server`, with the API key the harness's servers expect."""
    import httpx
    from server_harness import API_KEY

    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        yield http
