"""An adapter is untrusted input (coreserve/worker/lora/adapter.py and adapter_files.py, coreserve/engine_core/lora_table.py's
allowed_path): each A and B is checked against its own target's sizes (a k_proj B as wide as k and v
together is refused, never written into v's columns), r, lora_alpha and the config's shape by field, every
value finite, naming the tensor; a refused load in place leaves the old adapter serving; with
lora_allowed_roots a path outside the roots, or a link out of them, is refused naming the path. One
PEFT-written adapter on the built-in tiny model (k and v 64 wide each), edited into each bad form."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import IS_BF16_MODE
from test_lora import PARAMS, PROMPTS, rows, write_adapter

from coreserve import LLM, LoRARequest

pytestmark = pytest.mark.skipif(IS_BF16_MODE, reason="PEFT's adapters are written in fp32")

LAYER = "base_model.model.model.layers.{}.{}.lora_{}.weight"


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> tuple[Path, Path]:
    """(the engine's one allowed root, a folder outside it)."""
    return tmp_path_factory.mktemp("allowed"), tmp_path_factory.mktemp("outside")


@pytest.fixture(scope="module")
def good(tiny_path, roots) -> str:
    folder = roots[0] / "good"
    write_adapter(tiny_path, folder, 3, 4, 8, ["q_proj", "k_proj", "v_proj", "down_proj"])
    return str(folder)


@pytest.fixture(scope="module")
def engine(tiny_path, roots):
    with LLM(tiny_path, multiprocess=False, enable_lora=True, num_kv_blocks=64,
             lora_allowed_roots=[str(roots[0])]) as llm:
        yield llm


def edited(good: str, folder: Path, config=None, tensors=None) -> str:
    """A copy of `good` in `folder`: `config(dict)` gives the new adapter_config.json's value (any JSON),
    `tensors(dict)` edits the tensors in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, folder)
    if config is not None:
        values = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(config(values)))
    if tensors is not None:
        values = load_file(folder / "adapter_model.safetensors")
        tensors(values)
        save_file(values, folder / "adapter_model.safetensors")
    return str(folder)


def _set(key: str, value: torch.Tensor):
    return lambda t: t.__setitem__(key, value)


def _nan(key: str):
    return lambda t: t[key].view(-1).__setitem__(5, float("nan"))


def _rename(module: str, new_module: str):
    """Both of `module`'s tensors under `new_module`'s name."""
    return lambda t: t.update({k.replace(module, new_module): t.pop(k) for k in [k for k in t if module in k]})


K_B, Q_A, V_A = LAYER.format(0, "self_attn.k_proj", "B"), LAYER.format(0, "self_attn.q_proj", "A"), \
    LAYER.format(1, "self_attn.v_proj", "A")
DOWN = "model.layers.2.mlp.down_proj."
TENSOR_CASES = {  # name -> (edit, what the refusal says)
    "k_proj B as wide as k and v": (_set(K_B, torch.zeros(128, 4)),
                                    f"tensor '{K_B}' has shape (128, 4), expected (64, 4)"),
    "A of rank 2, B of rank 4": (_set(Q_A, torch.zeros(2, 256)), f"tensor '{Q_A}' has shape (2, 256), expected (4, 256)"),
    "a NaN": (_nan(V_A), f"tensor '{V_A}' holds non-finite values"),
    "an Inf": (_set(Q_A, torch.full((4, 256), float("inf"))), f"tensor '{Q_A}' holds non-finite values"),
    "a lone A": (lambda t: t.pop(K_B), "self_attn.k_proj has ['lora_A']: it lacks its A or B"),
    "down_proj under self_attn": (_rename(DOWN, DOWN.replace("mlp", "self_attn")),
                                  "target 'model.layers.2.self_attn.down_proj' is not built"),
    "an unknown target": (_rename(DOWN, DOWN.replace("down_proj", "w2")), "target 'model.layers.2.mlp.w2' is not built"),
    "integers": (_set(Q_A, torch.zeros(4, 256, dtype=torch.int64)), f"tensor '{Q_A}' is I64, not a float"),
}
CONFIG_CASES = {
    "r 0": (lambda c: {**c, "r": 0}, "r must be a positive integer, got 0"),
    "r a string": (lambda c: {**c, "r": "4"}, "r must be a positive integer, got '4'"),
    "alpha inf": (lambda c: {**c, "lora_alpha": float("inf")}, "lora_alpha must be a finite number >= 0, got inf"),
    "alpha NaN": (lambda c: {**c, "lora_alpha": float("nan")}, "lora_alpha must be a finite number >= 0, got nan"),
    "alpha negative": (lambda c: {**c, "lora_alpha": -8}, "lora_alpha must be a finite number >= 0, got -8"),
    "alpha past fp32": (lambda c: {**c, "lora_alpha": 1e300}, "lora_B.weight' times the scale 2.5e+299"),
    "a list": (lambda c: [c], "adapter_config.json must be a JSON object, got a list"),
}


@pytest.mark.parametrize("case", [*TENSOR_CASES, *CONFIG_CASES])
def test_a_bad_adapter_is_refused_by_name(engine, good, roots, case):
    tensors, words = TENSOR_CASES.get(case, (None, None))
    config, words = CONFIG_CASES.get(case, (None, words))
    folder = edited(good, roots[0] / re.sub(r"\W", "-", case), config, tensors)
    with pytest.raises(ValueError, match=re.escape(words)):
        engine.load_lora_adapter(f"bad {case}", folder)


def test_a_safetensors_header_that_overruns_its_file_is_refused(engine, good, roots):
    folder = Path(edited(good, roots[0] / "overrun"))
    header = json.dumps({Q_A: {"dtype": "F32", "shape": [4, 256], "data_offsets": [0, 4096]}}).encode()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    with pytest.raises(ValueError, match="adapter_model.safetensors is not a valid safetensors file"):
        engine.load_lora_adapter("overrun", str(folder))


def test_a_refused_load_in_place_leaves_the_old_adapter_serving(engine, good, roots):
    prompt = [{"prompt_token_ids": PROMPTS[1]}]
    int_id = engine.load_lora_adapter("policy", good)
    request = LoRARequest("policy", int_id, good)
    before, version = rows(engine.generate(prompt, PARAMS, use_tqdm=False, lora_request=request)[0]), \
        engine.get_weight_version()
    assert before != rows(engine.generate(prompt, PARAMS, use_tqdm=False)[0])  # the adapter moves the numbers
    wide = edited(good, roots[0] / "wide-inplace", tensors=TENSOR_CASES["k_proj B as wide as k and v"][0])
    with pytest.raises(ValueError, match="k_proj.lora_B.weight"):
        engine.load_lora_adapter("policy", wide, load_inplace=True)
    assert rows(engine.generate(prompt, PARAMS, use_tqdm=False, lora_request=request)[0]) == before
    assert ("policy", good) in engine.engine.list_lora_adapters() and engine.get_weight_version() == version


def test_allowed_roots_refuse_a_path_outside_and_a_link_out(engine, good, roots):
    inside, outside = roots
    copy = outside / "copy"
    shutil.copytree(good, copy)
    (inside / "link").symlink_to(copy)
    mixed = inside / "mixed"  # a folder inside whose weights are a link to a file outside
    mixed.mkdir()
    shutil.copy(copy / "adapter_config.json", mixed)
    (mixed / "adapter_model.safetensors").symlink_to(copy / "adapter_model.safetensors")
    for path in (copy, inside / "link", mixed, inside / ".." / outside.name / "copy"):
        with pytest.raises(ValueError, match=re.escape(f"lora_path {str(path)!r} is not under the allowed LoRA roots")):
            engine.load_lora_adapter("outside", str(path))
    with pytest.raises(Exception, match="not under the allowed LoRA roots"):  # a request's own path too
        engine.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False,
                        lora_request=LoRARequest("outside", 77, str(copy)))
    engine.load_lora_adapter("inside", str(outside / ".." / inside.name / "good"))  # resolved: inside
    assert engine.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_the_server_and_the_daemon_take_several_roots():
    from coreserve.engine_core.__main__ import build_config, make_parser
    from coreserve.frontend.engine.engine_args import make_config
    from coreserve.frontend.server.args import add_serve_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--enable-lora", "--lora-allowed-roots", "/a", "/b"])
    assert engine_kwargs(args)["lora_allowed_roots"] == ["/a", "/b"]
    daemon = make_parser()
    flags = ["--address", "ipc:///tmp/x", "--model", "builtin:tiny", "--lora-allowed-roots", "/a", "/b"]
    assert build_config(daemon, daemon.parse_args(flags)).lora_allowed_roots == ("/a", "/b")
    with pytest.raises(ValueError, match="lora_allowed_roots must name at least one folder"):
        make_config(None, {"lora_allowed_roots": []})
