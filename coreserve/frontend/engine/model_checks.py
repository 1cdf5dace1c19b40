"""What the user's process can check about a model folder before it spawns a core: a clear ValueError
here instead of a core that dies while loading (frontend process).

The core checks everything again as it loads; these checks only look at which files are there.
"""

from __future__ import annotations

from pathlib import Path

from coreserve.protocol.gguf_header import is_gguf

# Each entry is one complete tokenizer: any of them will do (what transformers' AutoTokenizer reads).
_TOKENIZER_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))


def check_model_folder(model: str, has_weights_here: bool) -> None:
    """`has_weights_here`: the weights load from this folder (a spawned or in-process core); False when
    attaching to a daemon, which needs only the tokenizer here."""
    path = Path(model)
    if is_gguf(model):
        if not path.is_file():
            raise ValueError(f"the GGUF file {model} does not exist")
        return
    if not path.exists():
        raise ValueError(f"the model folder {model} does not exist")
    if not path.is_dir():
        raise ValueError(f"{model} is not a folder: give a Hugging Face model folder or a .gguf file")
    if not any(all((path / name).is_file() for name in names) for names in _TOKENIZER_SETS):
        wanted = ", ".join(" + ".join(names) for names in _TOKENIZER_SETS)
        raise ValueError(f"the model folder {model} has no tokenizer (one of: {wanted})")
    if has_weights_here:
        _check_checkpoint(path)


def _check_checkpoint(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ValueError(f"the model folder {path} has no config.json: not a Hugging Face model folder")
    if (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors")):
        return
    others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f"; {', '.join(others[:3])} cannot be read: convert them to safetensors" if others else ""
    raise ValueError(f"the model folder {path} has no weights (*.safetensors files){hint}")
