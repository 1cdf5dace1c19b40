"""Start-up (issue 21's load time): what `LLM(model)` does before its first token, each behaviour that
keeps it short. The frontend imports no torch for the tokenizers AutoTokenizer would load as they are,
and loads it while its core starts; the core logs its phases; the model is built without torch's
meta-device decompositions; GGUF weights are dequantized a block of rows at a time into the parameter;
the KV cache is zero pages committed as written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coreserve.frontend.engine.engine_args import direct_tokenizer_class, load_tokenizer
from coreserve.protocol.builtin_model import builtin_model_path
from coreserve.worker.cpu.huge_pages import zero_page_tensors
from coreserve.worker.models import gguf_weights

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Hello world! The capital of France is Paris. 12345 <|im_end|> émigré  \n\t tabs"


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_llm_of_the_gguf_model_imports_no_torch_and_logs_both_processes_phases():
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "for name in ('coreserve',): logging.getLogger(name).setLevel(logging.INFO)\n"
        "from coreserve.frontend.llm import LLM\n"
        "from coreserve.protocol.sampling_params import SamplingParams\n"
        "with LLM('builtin:smollm2') as llm:\n"
        "    out = llm.generate(['The capital of France is'], SamplingParams(max_tokens=1, temperature=0),"
        " use_tqdm=False)\n"
        "print(repr(out[0].outputs[0].text), 'torch' in sys.modules)\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["'", "Paris'", "False"], proc.stdout  # " Paris", and no torch here
    for line in ("startup: tokenizer loaded after", "startup: core ready after", "startup: spawning",
                 "startup: process at", "startup: model load", "startup: KV cache"):
        assert line in proc.stderr, line


def test_spawned_core_stays_quiet_unless_the_engine_core_logger_is_set():
    code = (
        "from coreserve.frontend.llm import LLM\n"
        "with LLM('builtin:tiny') as llm:\n"
        "    llm.generate(['Hi'], use_tqdm=False)\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "startup:" not in proc.stderr and "INFO" not in proc.stderr


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_tokenizer_loaded_directly_is_the_one_autotokenizer_loads(name):
    from transformers import AutoTokenizer

    from coreserve.frontend.engine.gguf_tokenizer import gguf_tokenizer_folder

    path = builtin_model_path(name)
    folder = gguf_tokenizer_folder(path) if path.endswith(".gguf") else path
    assert direct_tokenizer_class(folder) is not None
    direct, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(folder)
    assert type(direct) is type(auto)
    assert direct(TEXT).input_ids == auto(TEXT).input_ids
    assert direct.all_special_ids == auto.all_special_ids and direct.chat_template == auto.chat_template
    assert direct.decode(auto(TEXT).input_ids) == auto.decode(auto(TEXT).input_ids)


def test_tokenizer_autotokenizer_replaces_is_left_to_autotokenizer(qwen_path):
    from transformers import AutoTokenizer

    assert direct_tokenizer_class(qwen_path) is None  # qwen2: AutoTokenizer picks Qwen2Tokenizer
    assert type(load_tokenizer(qwen_path)) is type(AutoTokenizer.from_pretrained(qwen_path))


def test_model_is_built_without_torch_dynamo(tiny_path):
    code = (
        "import sys, torch\n"
        "from coreserve.protocol.builtin_model import builtin_model_path\n"
        "from coreserve.worker.models.loader import load_model\n"
        "model = load_model(sys.argv[1], 'auto', torch.device('cpu'))\n"
        "print(model.rotary.cos.dtype, model.rotary.cos.device, 'torch._dynamo' in sys.modules)\n"
    )
    proc = _run(code, builtin_model_path("smollm2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["torch.float32", "cpu", "False"]


def test_gguf_weights_read_in_row_blocks_equal_the_whole_tensor(monkeypatch):
    path = builtin_model_path("smollm2")
    entry = next(e for e in gguf_weights.list_tensors(path) if e.name == "model.embed_tokens.weight")
    whole = gguf_weights.read_tensor(entry)
    monkeypatch.setattr(gguf_weights, "_BLOCK_BYTES", 1000 * entry.num_bytes // whole.shape[0] + 7)
    for dtype in (torch.float32, torch.bfloat16):
        destination = torch.full(whole.shape, float("nan"), dtype=dtype)
        gguf_weights.read_into(entry, destination)
        assert torch.equal(destination, whole.to(dtype))


def test_kv_cache_zero_pages_are_zero_apart_and_uncommitted_until_written():
    def rss_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss_bytes()
    caches = zero_page_tensors(3, (2, 2, 65536, 64), torch.float32)  # 3 x 64 MiB
    assert caches is not None and rss_bytes() - before < 16 << 20  # nothing committed yet
    assert all(c.shape == (2, 2, 65536, 64) and c.is_contiguous() for c in caches)
    caches[1][1, 1, -1, -1] = 5.0
    assert caches[0].abs().sum() == 0 and caches[2].abs().sum() == 0 and caches[1].sum() == 5.0
    assert caches[1].data_ptr() % 4096 == 0 and caches[0].data_ptr() + caches[0].nbytes <= caches[1].data_ptr()
    assert zero_page_tensors(1, (1 << 50,), torch.float32) is None  # more than any machine: refused


def test_a_kv_cache_the_host_cannot_back_is_refused_at_start_naming_the_flag():
    """Zero pages are committed as written, so a cache larger than the memory the host has available
    (but within what the mapping allows) started before and failed under load. Now a given
    num_kv_blocks past MemAvailable stops the core at start, naming --num-kv-blocks; the default
    (kv_cache_gib past it) is cut to fit and the engine serves."""
    from coreserve import LLM, SamplingParams
    from coreserve.engine_core.core import host_memory_available
    from coreserve.frontend.errors import EngineDeadError

    available = host_memory_available()
    assert available is not None
    bytes_per_block = 2 * 2 * 16 * 2 * 32 * 4  # builtin:tiny: (K, V) x 2 layers x 16 tokens x 2 KV heads x 32 x fp32
    blocks = int(available * 1.2) // bytes_per_block
    with pytest.raises(EngineDeadError, match="num-kv-blocks"):
        with LLM("builtin:tiny", num_kv_blocks=blocks):
            pass
    with LLM("builtin:tiny", kv_cache_gib=available * 1.2 / 2**30, max_num_seqs=10**6) as llm:
        assert llm.facts.num_kv_blocks * bytes_per_block <= 0.9 * host_memory_available() + 2**30  # cut to fit
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
