"""coreserve/engine_core/server.py's release_heap: the freed pages glibc keeps in its heap go back to the OS; and
a core process's busy loop calls it when the core goes idle after a step, once a burst (so a burst's
activations do not stay resident), counted in its stats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import PROMPTS

from coreserve import SamplingParams
from coreserve.engine_core.server import MALLOC_TRIM, release_heap


def _anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon")


@pytest.mark.skipif(MALLOC_TRIM is None or not Path("/proc/self/status").exists(), reason="glibc and /proc only")
def test_freed_heap_pages_go_back_to_the_os():
    tensors = [torch.ones(16 * 1024) for _ in range(3200)]  # 64 KiB each: under glibc's mmap threshold, heap
    committed = _anon_mib()
    kept = tensors[::16]  # a live tensor every 1 MiB: the heap cannot shrink from its top alone
    del tensors
    retained = _anon_mib()
    assert retained > committed - 50, "glibc gave the pages back by itself: this test shows nothing"
    release_heap()
    released = _anon_mib()
    assert released < retained - 150, (committed, retained, released)
    assert all(float(t[0]) == 1.0 for t in kept)  # the live ones untouched


@pytest.mark.skipif(MALLOC_TRIM is None, reason="glibc only")
def test_a_core_process_releases_its_heap_once_each_time_it_goes_idle(llm_mp):
    before = llm_mp.get_engine_stats().num_heap_releases
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm_mp.generate(PROMPTS[:3], params, use_tqdm=False)
    # The release follows the last step's outputs in the busy loop, so a GetStats sent after them is
    # answered after it.
    after_burst = llm_mp.get_engine_stats().num_heap_releases
    assert after_burst >= before + 1
    assert llm_mp.get_engine_stats().num_heap_releases == after_burst  # idle turns of the loop: no more
    llm_mp.generate(PROMPTS[:1], params, use_tqdm=False)
    assert llm_mp.get_engine_stats().num_heap_releases == after_burst + 1


def _vm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmSize")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="/proc only")
def test_a_closed_in_process_engine_gives_its_mappings_back(tiny_path):
    """An in-process engine's weights and KV cache are mappings (huge-page weights, zero-page cache) of
    gigabytes of address space: closing the engine unmaps them at once, so a process that opens engine
    after engine (a test suite, a notebook) stays the size of one. The huge-page collapse's thread held
    them 5 s and more after close; a reference cycle held them until a collection ran."""
    from coreserve import LLM

    sizes = []
    for _ in range(3):
        with LLM(tiny_path, multiprocess=False) as llm:
            llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
            opened = _vm_mib()
        sizes.append(_vm_mib())
        assert opened - sizes[-1] > 200  # this engine's mappings (KV cache, weights) are gone on close
    assert sizes[-1] - sizes[0] < 100  # three engines, one after another: no growth
