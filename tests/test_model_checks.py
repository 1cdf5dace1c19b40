"""A model folder that cannot load: a clear ValueError before any core is spawned where the user's process
can tell (no folder, config, weights or tokenizer), else the core's own reason in the EngineDeadError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from coreserve import LLM, EngineDeadError
from coreserve.frontend.engine.model_checks import check_model_folder


def copy_model(src: str, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """A copy of the folder without the files whose names end with any of `skip`."""
    dst.mkdir()
    for item in Path(src).iterdir():
        if not item.name.endswith(skip) and item.is_file():
            shutil.copy(item, dst / item.name)
    return dst


@pytest.mark.parametrize(
    "skip, message",
    [
        ((".safetensors", ".safetensors.index.json"), r"no weights \(\*\.safetensors files\)"),
        (("config.json",), "has no config.json"),
        (("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model"), "has no tokenizer"),
    ],
)
def test_a_folder_missing_a_part_is_a_value_error_before_spawning(tiny_path, tmp_path, skip, message):
    folder = copy_model(tiny_path, tmp_path / "model", skip)
    with pytest.raises(ValueError, match=message) as info:
        LLM(str(folder))
    assert str(folder) in str(info.value)
    assert not isinstance(info.value, EngineDeadError)  # refused here: no core was started


def test_a_missing_folder_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_pytorch_bin_weights_are_named_in_the_error(tiny_path, tmp_path):
    folder = copy_model(tiny_path, tmp_path / "model", (".safetensors", ".safetensors.index.json"))
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="pytorch_model.bin cannot be read: convert them to safetensors"):
        check_model_folder(str(folder), has_weights_here=True)


def test_attaching_to_a_daemon_needs_only_the_tokenizer_here(tiny_path, tmp_path):
    folder = copy_model(tiny_path, tmp_path / "model", (".safetensors", "config.json"))
    check_model_folder(str(folder), has_weights_here=False)
    with pytest.raises(ValueError, match="no config.json"):
        check_model_folder(str(folder), has_weights_here=True)


def test_a_core_that_fails_to_load_raises_with_its_own_error_text(tiny_path, tmp_path):
    """The folder passes the frontend's checks, but the core refuses its config as it loads."""
    folder = copy_model(tiny_path, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineDeadError) as info:
        LLM(str(folder))
    message = str(info.value)
    assert "ValueError: hidden_act='gelu' is not supported (only silu)" in message
    assert "exited with code 1" in message


def test_a_core_with_unreadable_weights_says_why(tiny_path, tmp_path):
    folder = copy_model(tiny_path, tmp_path / "model", (".safetensors", ".safetensors.index.json"))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(EngineDeadError, match="the engine core failed to start: .*Error: .*exited with code"):
        LLM(str(folder))
