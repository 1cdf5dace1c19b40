"""The GGUF file of a hybrid fuzz case (tests/gguf_fuzz_hybrid.py's families) as llama.cpp's own converter
writes it, re-typed per the case, and the safetensors twin of what it holds (tests/gguf_fuzz_files.py calls it).

The converter (convert_hf_to_gguf.py from the folder scripts/setup.sh --test extracts, run in a subprocess as
tests/test_gguf_hybrid.py runs it) writes the case's folder as F32. It also writes an index folder: the same
folder with the values of every tensor of two or more dimensions (but the embedding and the output) replaced
by their position, 1, 2, ... through each layer's tensors laid end to end (exact in float32). Each value of a
converted tensor then names the folder value it came from: the tensors llama-quantize may quantize are
gathers (rows split, value heads tiled, q/k rows interleaved, experts split and stacked), checked here: the
F32 file's values are the folder's at those positions, bit for bit. Each such tensor is then re-typed by
gguf_fuzz_files.encode in the case's type for it (with llama-quantize's fallbacks), or the real llama-quantize
quantizes the F32 file for its recipes; the twin is the folder with each re-typed value put back where it came
from. Everything else (norms as 1 + w, ssm_a as -exp(A_log), the conv kernels) stays as the converter wrote it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf_fuzz import LLAMA_QUANTIZE, FuzzCase, fitted_type
from gguf_fuzz_files import encode

# where scripts/setup.sh --test extracts llama.cpp's converter (tests/test_gguf_hybrid.py's CONVERTER)
CONVERTER = Path.home() / ".cache" / "coreserve" / "llama.cpp-convert-0.3.36"
_FLAGS = {"qwen3_5": ["--no-mtp"], "qwen3_next": ["--no-mtp"]}  # LFM2's and Granite's converters refuse it
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
_EXACT = 1 << 24  # positions past this are not exact in float32


@dataclass(frozen=True)
class Origin:
    """Where a converted tensor's values are in the folder: the folder tensor `whole` as it is (the embedding,
    the output), or the flat positions `index` (shaped as the tensor) in layer `layer`'s tensors end to end."""

    whole: str | None = None
    layer: int = -1
    index: np.ndarray | None = None


def converter_missing() -> str | None:
    """Why a hybrid case cannot run here, or None."""
    if not (CONVERTER / "convert_hf_to_gguf.py").exists():
        return f"llama.cpp's converter is not at {CONVERTER} (scripts/setup.sh --test extracts it)"
    return None


def write_converted(
    case: FuzzCase, source: Path, tensors: dict[str, np.ndarray], path: Path, llama_quantize: str | None
) -> tuple[dict, dict]:
    """The case's GGUF at `path` from its folder `source` (whose tensors are `tensors`). Returns the twin's
    HF-named fp32 values and each re-typed tensor's types (asked, written)."""
    groups = _groups(tensors)
    index_folder = path.parent / "index"
    _write_index_folder(source, tensors, groups, index_folder)
    f32, index = path.with_name("converted-f32.gguf"), path.with_name("converted-index.gguf")
    run_converter({f32: source, index: index_folder}, _FLAGS.get(case.family, []))
    origins = gathers(f32, index, tensors, groups)
    if case.weight_type in LLAMA_QUANTIZE:
        assert llama_quantize is not None, f"{case.name}: no llama-quantize binary given"
        values, types = _llama_quantized(case, f32, path, origins, llama_quantize)
    else:
        values, types = retype(case, f32, path, origins)
    return twin(tensors, groups, values, origins), types


def _groups(tensors: dict[str, np.ndarray]) -> dict[int, list[str]]:
    """Layer -> its tensors of two or more dimensions, in name order (-1: outside the layers, less the
    embedding and the output, which the converter copies whole)."""
    groups: dict[int, list[str]] = {}
    for name in sorted(tensors):
        if tensors[name].ndim >= 2 and name not in _TOP.values():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            groups.setdefault(layer, []).append(name)
    for layer, names in groups.items():
        assert sum(tensors[n].size for n in names) < _EXACT, f"layer {layer} too large to index in float32"
    return groups


def _write_index_folder(source: Path, tensors: dict, groups: dict[int, list[str]], folder: Path) -> None:
    """`source` with each grouped tensor's values replaced by their 1-based position in its group."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (folder / item.name).symlink_to(item.resolve())
    indexed = dict(tensors)
    for names in groups.values():
        start = 1
        for name in names:
            size = tensors[name].size
            indexed[name] = np.arange(start, start + size, dtype=np.float32).reshape(tensors[name].shape)
            start += size
    save_file(indexed, str(folder / "model.safetensors"), metadata={"format": "pt"})


def run_converter(jobs: dict[Path, Path], flags: list[str]) -> None:
    """{GGUF file: HF folder}: llama.cpp's converter on each at once, F32."""
    env = dict(os.environ, PYTHONPATH=str(CONVERTER / "gguf-py"), HF_HUB_OFFLINE="1")
    procs = {
        out: subprocess.Popen(
            [sys.executable, str(CONVERTER / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
             "--outfile", str(out), *flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for out, folder in jobs.items()
    }
    try:
        for out, proc in procs.items():
            log = proc.communicate(timeout=600)[0]
            if proc.returncode:  # the exception's line first (a report's one line), then the log's end
                lines = log.strip().splitlines() or ["(no output)"]
                tail = "\n".join(lines[-30:])
                raise RuntimeError(f"llama.cpp's converter failed on {jobs[out]}: {lines[-1]}\n{tail}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """llama-quantize's rule for a tensor it may quantize (tensor_allows_quantization in src/llama-quant.cpp):
    two or more dimensions (ggml's: a leading 1 in numpy's order does not count), a `weight`, not a norm, not
    a router, not a conv kernel."""
    dims = len(shape) - next((i for i, size in enumerate(shape) if size != 1), len(shape))
    excluded = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "shortconv.conv.weight")
    return dims >= 2 and name.endswith("weight") and not any(part in name for part in excluded)


def gathers(f32: Path, index: Path, tensors: dict, groups: dict[int, list[str]]) -> dict[str, Origin]:
    """Each quantizable converted tensor's origin in the folder, checked against the F32 file's values."""
    flat = {layer: np.concatenate([tensors[n].ravel() for n in names]) for layer, names in groups.items()}
    positions = dict(_tensor_values(_layout(index)))
    origins = {}
    for name, values in _tensor_values(_layout(f32)):
        if not is_quantizable(name, values.shape):
            continue
        if name in _TOP:
            origin, want = Origin(whole=_TOP[name]), tensors[_TOP[name]]
        else:
            layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
            origin = Origin(layer=layer, index=_positions(name, positions[name], len(flat.get(layer, []))))
            want = flat[layer][origin.index]
        if want.shape != values.shape or not np.array_equal(want.view(np.uint32), values.view(np.uint32)):
            raise RuntimeError(f"{name}: the converter's values are not the folder's at its positions")
        origins[name] = origin
    return origins


def _layout(path: Path):
    """The file taken apart (tests/untrusted_fuzz_gguf_layout.py's walker, ~15x faster than gguf's reader on a
    50,000-token vocabulary), not kept in its cache."""
    from untrusted_fuzz_gguf_layout import read_layout

    return read_layout.__wrapped__(str(path))


def _tensor_values(layout) -> list[tuple[str, np.ndarray]]:
    """(name, values in numpy's order) of each tensor, fp32 (a quantized one dequantized by gguf's numpy)."""
    import gguf

    items = []
    for info in layout.tensors:
        raw, qtype = _raw(layout, info)
        values = gguf.quants.dequantize(raw, qtype)
        items.append((info.name, np.asarray(values, dtype=np.float32).reshape(tuple(reversed(info.dims)))))
    return items


def _raw(layout, info):
    """A tensor's bytes [..., row bytes] uint8 (numpy's order) and its ggml type."""
    import gguf

    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(info.dims))
    row_bytes = shape[-1] // block_size * type_size
    raw = np.frombuffer(layout.data, np.uint8, int(np.prod(shape[:-1])) * row_bytes, info.offset)
    return raw.reshape(*shape[:-1], row_bytes), qtype


def _positions(name: str, ids: np.ndarray, size: int) -> np.ndarray:
    """The 0-based positions an index file's tensor holds; RuntimeError where they are not positions."""
    positions = ids.astype(np.int64)
    if not np.array_equal(positions.astype(np.float32), ids) or not ((positions >= 1) & (positions <= size)).all():
        raise RuntimeError(f"{name}: the converter changed the values (not a gather); it cannot be re-typed here")
    return positions - 1


def retype(case: FuzzCase, f32: Path, path: Path, origins: dict[str, Origin]) -> tuple[dict, dict]:
    """The F32 file's metadata and tensors into `path`, each quantizable tensor in its fitted type. Returns
    their values as a reader gives them and their types (asked, written)."""
    import gguf
    from untrusted_fuzz_gguf_layout import TensorInfo, assemble, encode_entries, encode_tensor

    layout = _layout(f32)
    rng = np.random.default_rng(case.seed)
    values, types, infos, data = {}, {}, [], bytearray()
    for info, (name, tensor) in zip(layout.tensors, _tensor_values(layout)):
        stored, qtype = _raw(layout, info)  # a tensor not re-typed: the converter's bytes
        if name in origins:
            asked = case.requested_type(name, case.config["num_hidden_layers"])
            types[name] = (asked, fitted_type(asked, tensor.shape[-1]))
            stored, value = encode(tensor.reshape(-1, tensor.shape[-1]), types[name][1], rng)
            values[name], qtype = value.reshape(tensor.shape), gguf.GGMLQuantizationType[types[name][1]]
        data += bytes(-len(data) % 32)  # the default alignment
        infos.append(TensorInfo(name, info.dims, int(qtype), len(data)))
        data += stored.tobytes()
    path.write_bytes(assemble(encode_entries(list(layout.entries)), [encode_tensor(i) for i in infos], bytes(data)))
    return values, types


def _llama_quantized(case: FuzzCase, f32: Path, path: Path, origins: dict, llama_quantize: str) -> tuple[dict, dict]:
    """The F32 file quantized by llama-quantize with the case's recipe; its quantizable tensors read back
    (any other it changed is an error: the twin would not hold it)."""
    import gguf

    ftype = case.weight_type.split(":")[1]
    done = subprocess.run([llama_quantize, str(f32), str(path), ftype], capture_output=True, text=True)
    if done.returncode:  # its assertion's line, not the backtrace's last
        lines = (done.stdout + done.stderr).strip().splitlines() or ["(no output)"]
        reason = next((line for line in lines if "GGML_ASSERT" in line or "error" in line.lower()), lines[-1])
        raise RuntimeError(f"llama-quantize {ftype} failed: {reason.strip()}")
    layout = _layout(path)
    values, types = {}, {}
    for info, (name, value) in zip(layout.tensors, _tensor_values(layout)):
        kind = gguf.GGMLQuantizationType(info.ggml_type).name
        if name in origins:
            values[name], types[name] = value, (case.weight_type, kind)
        elif kind != "F32":
            raise RuntimeError(f"llama-quantize wrote {name} in {kind}; is_quantizable says it stays F32")
    return values, types


def twin(tensors: dict, groups: dict[int, list[str]], values: dict[str, np.ndarray], origins: dict) -> dict:
    """The folder's tensors with each re-typed value put back where it came from; RuntimeError where the
    converter copied one folder value into two places that now differ."""
    flat = {layer: np.concatenate([tensors[n].ravel() for n in names]) for layer, names in groups.items()}
    expected = dict(tensors)
    for name, value in values.items():
        origin = origins[name]
        if origin.whole is not None:
            expected[origin.whole] = value.reshape(tensors[origin.whole].shape)
        else:
            flat[origin.layer][origin.index.ravel()] = value.ravel()
    for name, value in values.items():
        origin = origins[name]
        if origin.whole is None and not np.array_equal(flat[origin.layer][origin.index], value):
            raise RuntimeError(f"{name}: a folder value copied twice was re-typed to two values")
    for layer, names in groups.items():
        parts = np.split(flat[layer], np.cumsum([tensors[n].size for n in names])[:-1])
        expected.update({n: part.reshape(tensors[n].shape) for n, part in zip(names, parts)})
    return expected
