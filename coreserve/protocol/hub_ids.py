"""Models, GGUF files and LoRA adapters named by Hugging Face hub id, resolved to local paths with
`huggingface_hub` (its cache; `HF_TOKEN`, `HF_HUB_OFFLINE`, `HF_ENDPOINT`, `HF_HOME` are read by
huggingface_hub itself, as it is imported in the entry process).

Runs in the process that loads what is named (no torch): the frontend before it spawns a core (the
model, a draft model, an adapter), a daemon for its own model. Only an argument that is no existing
local path and has a hub id's shape is resolved, so a local path always wins:
  ORG/NAME            a Hugging Face model folder: its top-level config, tokenizer and safetensors files
                      alone are downloaded (never a pickle); a repo of GGUF files alone: as ORG/NAME:Q4_K_M
  ORG/NAME:QUANT      llama.cpp's `-hf` form: the .gguf file whose name ends in QUANT (any case)
  ORG/NAME/FILE.gguf  that file of the repo
What is downloaded is then loaded as any local file is, with every check of docs/untrusted_files.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

logger = logging.getLogger(__name__)

# Top level only (ignore "*/*"): what the loader reads from a folder; *.bin/*.pt pickles are never fetched
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's, for a repo of GGUF files named without a tag
_HUB_ID = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
    r"(?::(?P<quant>[A-Za-z0-9][\w.-]*)|/(?P<file>[\w.-]+(?:/[\w.-]+)*\.gguf))?",
    re.IGNORECASE,
)
_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)  # llama.cpp's gguf-split names
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubId:
    text: str  # as given
    repo_id: str
    quant: str | None = None  # llama.cpp's :QUANT tag
    filename: str | None = None  # a .gguf file in the repo


def parse_hub_id(text: str) -> HubId | None:
    """`text` as a hub id; None where it has no hub id's shape (a NAME ending in .gguf is a local file's)."""
    match = _HUB_ID.fullmatch(text)
    if match is None or ".." in text or "--" in match["repo"]:
        return None
    if match["quant"] is None and match["file"] is None and text.lower().endswith(".gguf"):
        return None
    return HubId(text, match["repo"], match["quant"], match["file"])


def hub_id_to_fetch(path: str) -> HubId | None:
    """The hub id `path` names, where it is no existing local path; else None."""
    return None if os.path.exists(path) else parse_hub_id(path)


def repo_cache_folder(repo_id: str) -> Path:
    """Where huggingface_hub keeps a model repo's files (its documented cache layout): the snapshots, and
    the blobs they link to."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))


def local_model_path(model: str, revision: str | None = None, with_weights: bool = True) -> str:
    """The local folder or file `model` names: `builtin:NAME` made on first use; an existing path, or
    anything of no hub id's shape, as given (the loader names what is wrong); a hub id downloaded (or
    found in the cache). `revision`: a branch, tag or commit of the hub id. `with_weights`: False for a
    process that reads only the tokenizer and config (a frontend attached to a daemon)."""
    hub_id = None if model.startswith("builtin:") else hub_id_to_fetch(model)
    if hub_id is None and revision is not None:
        raise ValueError(f"revision {revision!r} is for a model given by hub id (ORG/NAME); {model!r} is not one")
    if model.startswith("builtin:"):
        from coreserve.protocol.builtin_model import builtin_model_path

        return builtin_model_path(model.split(":", 1)[1])
    if hub_id is None:
        return model
    with _hub_errors(hub_id, revision):
        files, where = _repo_files(hub_id.repo_id, revision)
        if hub_id.quant is None and hub_id.filename is None and "config.json" in files:
            path = _snapshot(hub_id.repo_id, revision, _folder_files(hub_id.repo_id, revision, files, with_weights))
        else:
            path = _download(hub_id.repo_id, _gguf_file(hub_id, files, where), revision)
    logger.info("%s (revision %s): %s", model, revision or "main", path)
    return path


def local_adapter_path(path: str) -> str:
    """A LoRA adapter's folder: `path` as given where it exists or has no `ORG/NAME` shape; else the
    hub repo's adapter_config.json and adapter_model.safetensors, downloaded (or found in the cache)."""
    hub_id = hub_id_to_fetch(path)
    if hub_id is None or hub_id.quant is not None or hub_id.filename is not None:
        return path
    with _hub_errors(hub_id, None):
        return _snapshot(hub_id.repo_id, None, ADAPTER_FILES)


_NO_WEIGHTS = tuple(p for p in MODEL_FILES if p != "*.safetensors")
_INDEX = "model.safetensors.index.json"


def _folder_files(repo_id: str, revision: str | None, files: list[str], with_weights: bool) -> tuple[str, ...]:
    """What to fetch of a folder: MODEL_FILES, but of the safetensors only the shards an index names, as
    the loader reads (a repo may hold its weights twice: Mistral's consolidated.safetensors)."""
    if not with_weights:
        return _NO_WEIGHTS
    if _INDEX not in files:
        return MODEL_FILES
    try:
        shards = json.loads(Path(_download(repo_id, _INDEX, revision)).read_text()).get("weight_map", {}).values()
    except (AttributeError, ValueError):  # not an index: every *.safetensors, and the loader says what is wrong
        return MODEL_FILES
    return (*_NO_WEIGHTS, *sorted({str(name) for name in shards}))


def _repo_files(repo_id: str, revision: str | None) -> tuple[list[str], str]:
    """The repo's file names and where they were listed: on the hub, or (offline, or the hub out of
    reach, as huggingface_hub's own downloads fall back) in the cache."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    if not constants.HF_HUB_OFFLINE:
        try:
            # a client made now reads the endpoint and token as they are now (the module-level one kept
            # those of its import)
            return HfApi().list_repo_files(repo_id, revision=revision), "on the hub"
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise
        except Exception as exc:  # noqa: BLE001 - the hub out of reach or down: whatever its client raised
            logger.warning("the Hugging Face hub cannot list %s (%r): looking in the cache", repo_id, exc)
    files = _cached_files(repo_id, revision)
    if files is None:
        raise LocalEntryNotFoundError(f"{repo_id} is not in the cache")
    return files, "in the cache"


def _cached_files(repo_id: str, revision: str | None) -> list[str] | None:
    """The files of the cached snapshot of `revision` (refs/REVISION names its commit); None: none."""
    storage = repo_cache_folder(repo_id)
    revision = revision or "main"
    try:
        commit = revision if _COMMIT.fullmatch(revision) else (storage / "refs" / revision).read_text().strip()
    except OSError:
        return None
    snapshot = storage / "snapshots" / commit
    if not commit or not snapshot.is_dir():
        return None
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _gguf_file(hub_id: HubId, files: list[str], where: str) -> str:
    """The one .gguf file the id names: its FILE, or the file of its quant (none given: DEFAULT_QUANT, or
    the repo's only GGUF file); a split file is refused."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if not ggufs:
        raise ValueError(f"{hub_id.text!r}: {hub_id.repo_id} has neither config.json (a Hugging Face model folder) "
                         f"nor .gguf files {where}")
    if hub_id.filename is not None:
        chosen = [f for f in ggufs if f == hub_id.filename]
        wanted = f"file {hub_id.filename}"
    else:
        quant = hub_id.quant or DEFAULT_QUANT
        chosen = [f for f in ggufs if _has_quant(f, quant)]
        if not chosen and hub_id.quant is None and len(ggufs) == 1:
            chosen = ggufs
        wanted = f"GGUF file of quant {quant}"
    if not chosen:
        raise ValueError(f"{hub_id.text!r}: no {wanted} in {hub_id.repo_id} {where}; its GGUF files: "
                         f"{', '.join(ggufs[:20])}")
    split = [f for f in chosen if _SPLIT_PART.search(f)]
    if split:
        raise ValueError(f"{hub_id.text!r}: {split[0]} is one part of a GGUF split in {len(split)} files; coreserve "
                         "reads one-file GGUFs: join the parts with llama.cpp's `llama-gguf-split --merge` and give "
                         "the joined file's path")
    if len(chosen) > 1:
        raise ValueError(f"{hub_id.text!r}: {len(chosen)} files match ({', '.join(chosen)}); name one as "
                         f"{hub_id.repo_id}/FILE.gguf")
    return chosen[0]


def _has_quant(filename: str, quant: str) -> bool:
    """llama.cpp's match: the name, without .gguf, is the quant or ends in it after '.', '-' or '_'."""
    stem = _SPLIT_PART.sub(".gguf", PurePosixPath(filename).name)[: -len(".gguf")].lower()
    quant = quant.lower()
    return stem == quant or (stem.endswith(quant) and stem[-len(quant) - 1] in ".-_")


def _snapshot(repo_id: str, revision: str | None, patterns: tuple[str, ...]) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns), ignore_patterns=["*/*"])


def _download(repo_id: str, filename: str, revision: str | None) -> str:
    from huggingface_hub import hf_hub_download

    return hf_hub_download(repo_id, filename, revision=revision)


@contextlib.contextmanager
def _hub_errors(hub_id: HubId, revision: str | None) -> Iterator[None]:
    """huggingface_hub's refusals as ValueErrors naming the id and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except LocalEntryNotFoundError as exc:
        reach = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise ValueError(
            f"{hub_id.text!r} is neither a local path nor in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and {reach}: download it once online (HF_HUB_OFFLINE unset), or give a local path"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ValueError(f"{hub_id.text!r}: no revision {revision!r} of {hub_id.repo_id} on the hub") from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(
            f"{hub_id.text!r} is neither a local path nor a model repository on the Hugging Face hub "
            f"({constants.ENDPOINT}) that this token may read: check the id, or set HF_TOKEN for a private "
            "or gated one"
        ) from exc
    except EntryNotFoundError as exc:
        raise ValueError(f"{hub_id.text!r}: a file is missing from {hub_id.repo_id} on the hub ({exc})") from exc
