"""A model file is untrusted input (llama.cpp's GGUF parser CVEs): the GGUF header reader
(coreserve/protocol/gguf_header.py) and the safetensors header and index reader (coreserve/worker/models/safetensors_files.py)
check every count, size and offset before they use it. Each hand-made malformed file ends in a plain
ValueError naming the field: never an OverflowError, RecursionError, KeyError, numpy's or json's own
error, a huge allocation or a long loop."""

from __future__ import annotations

import json
import random
import re
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from coreserve.protocol.gguf_header import GGML_BLOCKS, read_gguf_header
from coreserve.worker.models import safetensors_files
from coreserve.worker.models.gguf_weights import SUPPORTED_TYPES

U32, U64, STRING, ARRAY, F32, Q8_0 = 4, 10, 8, 9, 0, 8


def refused(call, *args) -> str:
    """The message of the ValueError `call(*args)` raises: exactly a ValueError, no subclass (json's
    JSONDecodeError) and no other error."""
    with pytest.raises(ValueError) as info:
        call(*args)
    assert type(info.value) is ValueError, repr(info.value)
    return str(info.value)


# --- GGUF, by hand ---------------------------------------------------------------------------------


def string(text: bytes | str) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def entry(key: bytes | str, value_type: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", value_type) + payload


def tensor(name: bytes | str, dims: tuple[int, ...], ggml_type: int = F32, offset: int = 0) -> bytes:
    dims_part = struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
    return string(name) + dims_part + struct.pack("<IQ", ggml_type, offset)


ARCH = entry("general.architecture", STRING, string("llama"))
FOUR_F32 = tensor("t", (4,))


def gguf(entries: Sequence[bytes] = (ARCH,), tensors: Sequence[bytes] = (FOUR_F32,), data: bytes = bytes(64),
         counts: tuple[int, int] | None = None, version: int = 3) -> bytes:
    """A GGUF file: `counts` (tensors, metadata entries) when they should lie about the lists."""
    num_tensors, num_entries = counts or (len(tensors), len(entries))
    head = b"GGUF" + struct.pack("<IQQ", version, num_tensors, num_entries)
    head += b"".join(entries) + b"".join(tensors)
    return head + bytes(-len(head) % 32) + data


@pytest.fixture
def read_bytes(tmp_path):
    """Writes each file under a new name (the reader caches a header by path, size and mtime)."""
    names = iter(range(10**6))

    def read(data: bytes):
        path = tmp_path / f"m{next(names)}.gguf"
        path.write_bytes(data)
        return read_gguf_header(str(path))

    return read


def test_a_well_formed_hand_made_file_reads(read_bytes):
    header = read_bytes(gguf(tensors=[tensor("a", (4,)), tensor("b", (32, 2), Q8_0, 32)], data=bytes(128)))
    assert [(t.name, t.dims, t.num_bytes) for t in header.tensors] == [("a", (4,), 16), ("b", (32, 2), 68)]
    assert header.tensors[1].offset - header.tensors[0].offset == 32


def with_entries(*entries: bytes, **kwargs) -> bytes:
    return gguf(entries=entries, **kwargs)


def with_tensors(*tensors: bytes, **kwargs) -> bytes:
    return gguf(tensors=tensors, **kwargs)


def array(item_type: int, count: int, items: bytes = b"") -> bytes:
    return struct.pack("<IQ", item_type, count) + items


def alignment(value_type: int, payload: bytes) -> bytes:
    return with_entries(ARCH, entry("general.alignment", value_type, payload))


BAD_GGUF = {
    "empty file": (b"", "empty"),
    "magic only": (b"GGUF", "version"),
    "version 1": (gguf(version=1), "version 1"),
    "truncated counts": (b"GGUF" + struct.pack("<I", 3) + bytes(5), "tensor and metadata counts"),
    "metadata count 2^64-1": (gguf(counts=(1, 2**64 - 1)), "metadata count"),
    "tensor count 2^60": (gguf(counts=(2**60, 1)), "tensor count"),
    "key length 2^63": (with_entries(struct.pack("<Q", 2**63) + b"k"), "metadata key #0"),
    "key not UTF-8": (with_entries(entry(b"\xff\xfe", U32, bytes(4))), "metadata key #0 is not UTF-8"),
    "repeated key": (with_entries(ARCH, ARCH), "'general.architecture' appears twice"),
    "unknown value type": (with_entries(entry("x", 13, bytes(8))), "'x' has unknown GGUF metadata value"),
    "string past the file": (with_entries(entry("x", STRING, struct.pack("<Q", 2**40)), tensors=[], data=b""),
                             "metadata 'x' needs"),
    "u32 array count 2^60": (with_entries(entry("x", ARRAY, array(U32, 2**60))),
                             "'x' \\(an array of 1152921504606846976 values\\)"),
    "string array count 2^60": (with_entries(entry("x", ARRAY, array(STRING, 2**60))), "'x' array count"),
    "string array item past the file": (
        with_entries(entry("x", ARRAY, array(STRING, 2, string("a") + struct.pack("<Q", 2**50)))),
        r"'x'\[1\] \(a string of"),
    "string array item not UTF-8": (with_entries(entry("x", ARRAY, array(STRING, 1, string(b"\xc3")))),
                                    r"'x'\[0\] is not UTF-8"),
    "array of arrays": (with_entries(entry("x", ARRAY, array(ARRAY, 1, array(U32, 1, bytes(4))))),
                        "'x' is an array of arrays"),
    "array of unknown type": (with_entries(entry("x", ARRAY, array(77, 1))), "'x' is an array of unknown"),
    "alignment 0": (alignment(U32, struct.pack("<I", 0)), "general.alignment=0"),
    "alignment 3": (alignment(U32, struct.pack("<I", 3)), "general.alignment=3"),
    "alignment 2^31": (alignment(U32, struct.pack("<I", 2**31)), "general.alignment=2147483648"),
    "alignment a string": (alignment(STRING, string("32")), "general.alignment='32'"),
    "alignment a bool": (alignment(7, b"\x01"), "general.alignment=True"),
    "n_dims 2^32-1": (with_tensors(string("t") + struct.pack("<I", 2**32 - 1) + bytes(64)), "'t' n_dims is"),
    "n_dims 5": (with_tensors(tensor("t", (1, 1, 1, 1, 1))), "'t' n_dims is 5"),
    "n_dims 0": (with_tensors(tensor("t", ())), "'t' n_dims is 0"),
    "a zero dim": (with_tensors(tensor("t", (4, 0))), "'t' dims \\[4, 0\\] have a zero"),
    "2^80 elements": (with_tensors(tensor("t", (2**40, 2**40))), "'t' dims .* more than 2\\^63 - 1"),
    "unknown ggml type": (with_tensors(tensor("t", (4,), 4)), "'t' ggml type 4 is not a known"),
    "rows not whole blocks": (with_tensors(tensor("t", (33, 2), Q8_0)), "'t' dims: rows of 33 values"),
    "unaligned offset": (with_tensors(tensor("t", (4,), F32, 4)), "'t' offset 4 is not a multiple"),
    "tensor past the file": (with_tensors(tensor("t", (64,))), "'t' offset .* past the file's end"),
    "data offset 2^64-64": (with_tensors(tensor("t", (4,), F32, 2**64 - 64)), "'t' offset .* past the file"),
    "repeated tensor name": (with_tensors(FOUR_F32, tensor("t", (4,), F32, 32)), "'t' appears twice"),
    "empty tensor name": (with_tensors(tensor("", (4,))), "tensor #0 name '' is empty"),
    "300-byte tensor name": (with_tensors(tensor("n" * 300, (4,))), "tensor #0 name .* over 256 bytes"),
    "tensor name past the file": (with_tensors(struct.pack("<Q", 2**62), data=b""), "tensor #0 name needs"),
    "dims past the file": (with_tensors(string("t") + struct.pack("<I", 4), data=b""), "'t' dims needs"),
}


@pytest.mark.parametrize("case", list(BAD_GGUF))
def test_a_malformed_gguf_header_is_a_value_error_naming_the_field(read_bytes, case):
    data, field = BAD_GGUF[case]
    message = refused(read_bytes, data)
    assert re.search(field, message), message


def test_the_block_table_is_ggufs_and_covers_every_supported_type():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    known = {kind.value: sizes for kind, sizes in GGML_QUANT_SIZES.items()}
    for ggml_type, sizes in GGML_BLOCKS.items():
        assert ggml_type not in known or known[ggml_type] == sizes, ggml_type
    assert set(SUPPORTED_TYPES) <= set(GGML_BLOCKS)
    assert {t.value for t in GGMLQuantizationType} <= set(GGML_BLOCKS)


def written_gguf(path: Path) -> bytes:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "b", "ccc"])
    writer.add_token_scores([0.0, 1.0, 2.0])
    writer.add_tensor("a.weight", np.ones((2, 32), dtype=np.float32))
    writer.add_tensor("b.weight", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def test_mutations_of_a_written_file_read_or_fail_with_a_value_error(tmp_path, read_bytes):
    """A bounded fuzz of a file the gguf package wrote: bytes of its header overwritten with extremes,
    and the file cut short; each reads or is refused with a plain ValueError."""
    data = written_gguf(tmp_path / "ok.gguf")
    header = read_bytes(data)
    assert [t.name for t in header.tensors] == ["a.weight", "b.weight"]
    assert list(header.metadata["tokenizer.ggml.tokens"]) == ["a", "b", "ccc"]
    header_end = header.tensors[0].offset
    rng = random.Random(0)
    for _ in range(150):
        mutated = bytearray(data)
        at = rng.randrange(4, header_end)
        mutated[at : at + 8] = rng.choice([b"\xff" * 8, b"\x00" * 8, b"\x7f\xff\xff\xff", b"\x80", b"\x09"])
        try:
            read_bytes(bytes(mutated[: len(data)]))
        except ValueError as exc:
            assert type(exc) is ValueError, repr(exc)
    for cut in range(0, header_end, 7):
        assert type(pytest.raises(ValueError, read_bytes, data[:cut]).value) is ValueError


# --- safetensors ------------------------------------------------------------------------------------


def safetensors(header: dict | bytes, data: bytes = bytes(16), header_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


ENTRY_W = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def one(**fields) -> dict:
    """A header of one F32 tensor `w` of 4 values, `fields` replacing its own."""
    return {"__metadata__": {"format": "pt"}, "w": {**ENTRY_W, **fields}}


def read_header(tmp_path: Path, data: bytes) -> list:
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    return safetensors_files.read_header(path)


def test_a_well_formed_safetensors_file_reads(tmp_path):
    values = np.arange(4, dtype=np.float32)
    (found,) = read_header(tmp_path, safetensors(one(), values.tobytes()))
    data_start = 8 + len(json.dumps(one()))
    assert found.shape == (4,) and (found.start, found.end) == (data_start, data_start + 16)
    assert safetensors_files.read_tensor(found).tolist() == values.tolist()


BAD_SAFETENSORS = {
    "4-byte file": (b"\x01\x00\x00\x00", "no header length"),
    "header length 2^64-1": (safetensors(one(), header_len=2**64 - 1), "header length 18446744073709551615"),
    "header length past the file": (safetensors(one(), data=b"", header_len=200), "header length 200"),
    "header over 100 MB": (safetensors(one(), header_len=100_000_001), "header length 100000001"),
    "header not UTF-8": (safetensors(b'{"\xff": 1}'), "header is not UTF-8"),
    "header not JSON": (safetensors(b"{nope"), "header is not valid JSON"),
    "header nested 10^5 deep": (safetensors(b"[" * 100_000), "header is not valid JSON"),
    "header a list": (safetensors(b"[]"), "header is not a JSON object"),
    "repeated tensor": (safetensors(b'{"w": 1, "w": 2}'), "'w' appears twice"),
    "a 5000-digit offset": (safetensors(b'{"w": {"data_offsets": [' + b"9" * 5000 + b"]}}"), "not valid"),
    "metadata a list": (safetensors({"__metadata__": []}), "__metadata__"),
    "entry a number": (safetensors({"w": 3}), "tensor w: its header entry"),
    "no dtype": (safetensors(one(dtype=None)), "tensor w has dtype None"),
    "dtype a list": (safetensors(one(dtype=["F32"])), "tensor w has dtype"),
    "dtype I8": (safetensors(one(dtype="I8")), "tensor w has dtype I8, not supported"),
    "no shape": (safetensors(one(shape=None)), "tensor w: shape None"),
    "negative shape": (safetensors(one(shape=[-4])), "tensor w: shape \\[-4\\]"),
    "bool shape": (safetensors(one(shape=[True, 4])), "tensor w: shape"),
    "float shape": (safetensors(one(shape=[4.0])), "tensor w: shape"),
    "nine dims": (safetensors(one(shape=[1] * 8 + [4])), "tensor w: shape .* at most 8"),
    "no data_offsets": (safetensors(one(data_offsets=None)), "tensor w: data_offsets None"),
    "three offsets": (safetensors(one(data_offsets=[0, 8, 16])), "tensor w: data_offsets"),
    "begin after end": (safetensors(one(data_offsets=[16, 0])), "tensor w: data_offsets \\[16, 0\\]"),
    "end past the data": (safetensors(one(), data=bytes(8)), "tensor w: data_offsets .* <= 8"),
    "size not the shape's": (safetensors(one(data_offsets=[0, 12])), "shape \\[4\\] of F32 takes 16 bytes"),
    "overlap": (safetensors({**one(), "v": {**ENTRY_W, "shape": [2], "data_offsets": [8, 16]}}), "overlap"),
}


@pytest.mark.parametrize("case", list(BAD_SAFETENSORS))
def test_a_malformed_safetensors_header_is_a_value_error_naming_the_field(tmp_path, case):
    data, field = BAD_SAFETENSORS[case]
    message = refused(read_header, tmp_path, data)
    assert re.search(field, message), message


# --- the index ---------------------------------------------------------------------------------------


def folder_with_index(tmp_path: Path, index: object) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "a.safetensors").write_bytes(safetensors(one()))
    text = index if isinstance(index, bytes) else json.dumps(index).encode()
    (folder / "model.safetensors.index.json").write_bytes(text)
    return str(folder)


def naming(*shards: str) -> dict:
    return {"weight_map": {f"t{i}": shard for i, shard in enumerate(shards)}}


BAD_INDEXES = {
    "not UTF-8": (b"\xff{}", "index.json is not UTF-8"),
    "not JSON": (b"{", "index.json is not valid JSON"),
    "a list": ([], "index.json is not a JSON object"),
    "no weight_map": ({}, "weight_map is not"),
    "weight_map a list": ({"weight_map": ["a.safetensors"]}, "weight_map is not"),
    "weight_map empty": ({"weight_map": {}}, "weight_map is not a non-empty"),
    "a shard not a string": ({"weight_map": {"w": 1}}, r"weight_map\['w'\] is not a file name"),
    "a shard above the folder": (naming("../a.safetensors"), "'../a.safetensors', which is not a file name"),
    "an absolute shard": (naming("/etc/passwd"), "'/etc/passwd', which is not a file name"),
    "a shard in a sub-folder": (naming("sub/a.safetensors"), "'sub/a.safetensors', which is not a file name"),
    "a shard named ..": (naming(".."), "'..', which is not a file name"),
    "a missing shard": (naming("a.safetensors", "b.safetensors"), "'b.safetensors', which is not in"),
}


@pytest.mark.parametrize("case", list(BAD_INDEXES))
def test_a_malformed_index_is_a_value_error_naming_the_field(tmp_path, case):
    index, field = BAD_INDEXES[case]
    message = refused(safetensors_files.checkpoint_files, folder_with_index(tmp_path, index))
    assert re.search(field, message), message


def test_an_index_names_shards_in_the_folder_which_may_be_links(tmp_path):
    """A shard that is a link to a file elsewhere reads (the hub cache's snapshots and the tests' model
    folders are links); only the names the index gives are held to the folder."""
    folder = Path(folder_with_index(tmp_path, naming("a.safetensors", "b.safetensors")))
    (tmp_path / "blobs").mkdir()
    blob = tmp_path / "blobs" / "b"
    blob.write_bytes(safetensors({"v": ENTRY_W}))
    (folder / "b.safetensors").symlink_to(blob)
    assert [e.name for e in safetensors_files.list_tensors(str(folder))] == ["w", "v"]
