"""The GGUF differential fuzzer's fixed sample (tests/gguf_fuzz*.py; scripts/fuzz_models.py runs thousands):
random small models of every family, each written as a GGUF in one of the loader's types or a
llama-quantize-like mix, kept in their blocks give the bits of their fp32 dequantization, alone and
batched, and the fp32 run is HF's on the same weights to 1e-4. Families and types are paired as in a
Latin square (case i: family i mod 11, type i mod 17), three rounds of the 17 types, so that each type
meets three families and each family four or five types; about 40 s on this 2-core machine
(docs/testing.md). Where scripts/build_llama_server.sh has built llama-quantize, its own recipes too (MXFP4_MOE on
a mixture, whose experts it puts in MXFP4). The families whose files llama.cpp's converter writes
(CONVERTED_FAMILIES: the hybrids and issue 65's; the converter runs twice a case, 5-30 s) and the MXFP4 type are
left to scripts/fuzz_models.py.
"""

from __future__ import annotations

import pytest
from gguf_fuzz import FAMILIES, LLAMA_QUANTIZE, MIXES, TYPES, FuzzCase, draw_case
from gguf_fuzz_check import check_case
from gguf_fuzz_files import DEFAULT_LLAMA_QUANTIZE

ROUNDS = 3
SAMPLE = [draw_case(i, FAMILIES[i % len(FAMILIES)], (TYPES + MIXES)[i % len(TYPES + MIXES)])
          for i in range(ROUNDS * len(TYPES + MIXES))]
QUANTIZED = [draw_case(i, "mixtral" if ftype.endswith("MXFP4_MOE") else FAMILIES[i % len(FAMILIES)], ftype)
             for i, ftype in enumerate(LLAMA_QUANTIZE)]


def assert_case_passes(case: FuzzCase, tmp_path, llama_quantize: str | None = None) -> dict:
    """check_case's promises; returns the file's types (GGUF name -> asked, written)."""
    result = check_case(case, tmp_path, llama_quantize)
    assert not result.failures, "\n".join([case.describe(), *result.failures])
    return result.types


@pytest.mark.parametrize("case", SAMPLE, ids=[case.name for case in SAMPLE])
def test_a_random_gguf_gives_its_fp32_bits_kept_in_blocks_and_hfs_numbers(case, tmp_path):
    types = assert_case_passes(case, tmp_path)
    if case.weight_type in TYPES:  # the type itself was written (K types: at least the down projections)
        assert case.weight_type in {written for _, written in types.values()}, types


@pytest.mark.skipif(not DEFAULT_LLAMA_QUANTIZE.is_file(), reason="llama-quantize not built (build_llama_server.sh)")
@pytest.mark.parametrize("case", QUANTIZED, ids=[case.name for case in QUANTIZED])
def test_a_gguf_from_the_real_llama_quantize_gives_the_same_promises(case, tmp_path):
    assert_case_passes(case, tmp_path, str(DEFAULT_LLAMA_QUANTIZE))


def test_the_sample_covers_every_family_and_type_several_times():
    for names, key in ((FAMILIES, lambda c: c.family), (TYPES + MIXES, lambda c: c.weight_type)):
        counts = {name: sum(key(case) == name for case in SAMPLE) for name in names}
        assert min(counts.values()) >= ROUNDS, counts
