"""vLLM's `LoRARequest` (frontend process): the adapter a request runs with, given to `generate` (one,
or one a prompt) as `lora_request=`. The core loads `lora_path` (a PEFT folder on the core's host) the
first time it meets `lora_int_id` and keeps it under that id; where the engine has lora_allowed_roots, the
path must lie under one of them (docs/lora.md).

A `lora_path` (a LoRARequest's, a load's) that is no local path and has the shape ORG/NAME is a hub id:
`adapter_folder` fetches it here, in the frontend, and the core reads the folder it went to."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from coreserve.protocol.hub_ids import hub_id_to_fetch, local_adapter_path, repo_cache_folder
from coreserve.protocol.sampling_params import LoraRef, SamplingParams


class LoRARequest(msgspec.Struct, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # vLLM's; not read

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name or not self.lora_path:
            raise ValueError("LoRARequest needs lora_name and lora_path")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    def ref(self) -> LoraRef:
        return LoraRef(self.lora_name, self.lora_int_id, self.lora_path)


def with_lora(
    params: SamplingParams, lora_request: LoRARequest | None, folder_of: Callable[[str], str] = str
) -> SamplingParams:
    """`params` carrying the adapter to the core (SamplingParams.lora), its path as `folder_of` gives it
    (FrontendEngine.request_adapter_folder: a hub id's folder)."""
    if lora_request is None:
        return params
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
    ref = LoraRef(lora_request.lora_name, lora_request.lora_int_id, folder_of(lora_request.lora_path))
    return msgspec.structs.replace(params, lora=ref)


def adapter_folder(path: str, allowed_roots: tuple[str, ...] | None) -> str:
    """The path the core reads: `path` as given where it exists here or is no hub id; a hub id's folder in
    the Hugging Face cache, fetched. A local path always wins, so a hub id never stands for a folder here.
    Where lora_allowed_roots are set, a hub id is fetched only when its cache folder lies under one (the
    operator's choice to let clients load adapters from the hub: name the cache, or one repo's folder,
    among them), checked before anything is downloaded; the core checks the fetched folder again."""
    hub_id = hub_id_to_fetch(path)
    if hub_id is None:
        return path
    if allowed_roots is not None:
        folder = repo_cache_folder(hub_id.repo_id).resolve()
        if not any(folder.is_relative_to(Path(root).resolve()) for root in allowed_roots):
            raise ValueError(
                f"lora_path {path!r} is a Hugging Face hub id, and its cache folder {folder} is not under the "
                f"allowed LoRA roots (lora_allowed_roots, --lora-allowed-roots): add the hub cache "
                f"({folder.parent}) or that folder to them to load adapters by hub id"
            )
    return local_adapter_path(path)


def lora_per_prompt(lora_request, count: int) -> list[LoRARequest | None]:
    """One LoRARequest (or None) for every prompt, or a list of one a prompt, as vLLM takes them."""
    if isinstance(lora_request, Sequence) and not isinstance(lora_request, str | bytes):
        if len(lora_request) != count:
            raise ValueError(f"lora_request: {len(lora_request)} given for {count} prompts")
        return list(lora_request)
    return [lora_request] * count
