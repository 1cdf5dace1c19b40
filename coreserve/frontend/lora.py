"""vLLM's `LoRARequest` (frontend process): the adapter a request runs with, given to `generate` (one,
or one a prompt) as `lora_request=`. The core loads `lora_path` (a PEFT folder on the core's host) the
first time it meets `lora_int_id` and keeps it under that id; where the engine has lora_allowed_roots, the
path must lie under one of them (docs/lora.md)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

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


def with_lora(params: SamplingParams, lora_request: LoRARequest | None) -> SamplingParams:
    """`params` carrying the adapter to the core (SamplingParams.lora)."""
    if lora_request is None:
        return params
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
    return msgspec.structs.replace(params, lora=lora_request.ref())


def lora_per_prompt(lora_request, count: int) -> list[LoRARequest | None]:
    """One LoRARequest (or None) for every prompt, or a list of one a prompt, as vLLM takes them."""
    if isinstance(lora_request, Sequence) and not isinstance(lora_request, str | bytes):
        if len(lora_request) != count:
            raise ValueError(f"lora_request: {len(lora_request)} given for {count} prompts")
        return list(lora_request)
    return [lora_request] * count
