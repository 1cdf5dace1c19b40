"""PoolingParams (vLLM's names) and what a pooling engine tells its clients about its model (both
processes): a pooling request asks for one vector over its whole prompt (an embedding, or a classifier's
labels) instead of tokens; it travels to the core in `SamplingParams.pooling` (docs/serving.md, "Pooling").

Every field carries its type and bounds as a msgspec annotation, checked where the object is built and by
the core's typed decoder on arrival, as SamplingParams' are.
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Literal

import msgspec

# The tasks a request runs: "embed" (the pooled hidden state through the model's embedding modules) or
# "classify" (its score head). vLLM's token-level tasks are refused by name where a user can ask for them.
PoolingTask = Literal["embed", "classify"]
UNBUILT_POOLING_TASKS = ("token_embed", "token_classify", "plugin", "encode")
MAX_POOLED_SIZE = 1 << 20  # an embedding's width or a classifier's labels: more than any model has


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's PoolingParams. `normalize` (vLLM 0.10's name) and `use_activation` say the same for an
    embedding (L2-normalized, else the raw vector); for a classifier `use_activation` is softmax or
    sigmoid over the labels (False: the raw logits, what a reward model returns). None: the model's
    default. `dimensions`: the first N values of a Matryoshka embedding (then normalized)."""

    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)] | None = None
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=MAX_POOLED_SIZE)] | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: PoolingTask | None = None  # set by the entry point (embed, classify, score): vLLM's internal field

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """A ValueError naming the first field of the wrong type or out of range, or two that disagree."""
        for name, annotation in _field_types().items():
            value = getattr(self, name)
            try:
                msgspec.convert(value, annotation, strict=True)
            except msgspec.ValidationError as exc:
                raise ValueError(f"PoolingParams.{name}={value!r} is invalid: {exc}") from None
        if self.truncate_prompt_tokens == 0:
            raise ValueError("PoolingParams.truncate_prompt_tokens must be at least 1, or -1")
        both = (self.normalize, self.use_activation)
        if None not in both and both[0] != both[1]:
            raise ValueError("PoolingParams.normalize and use_activation disagree: give one of them (normalize is "
                             "vLLM's older name of use_activation for an embedding)")
        if self.task == "classify" and self.normalize is not None:
            raise ValueError("PoolingParams.normalize applies to embeddings; a classifier takes use_activation")
        if self.task == "classify" and self.dimensions is not None:
            raise ValueError("PoolingParams.dimensions applies to embeddings, not to a classifier's labels")

    def activation(self, default: bool) -> bool:
        """Whether to normalize (embed) or apply the labels' activation (classify); `default`: the model's."""
        for asked in (self.use_activation, self.normalize):
            if asked is not None:
                return asked
        return default


class PoolingFacts(msgspec.Struct, array_like=True, frozen=True):
    """A pooling engine's model, as the handshake states it: what a request may ask of it."""

    tasks: list[str]  # the PoolingTasks it serves: ["embed"] or ["classify"]
    output_size: int  # an embedding's width, or the number of labels
    labels: list[str] = msgspec.field(default_factory=list)  # a classifier's id2label, in order
    # the widths `dimensions` may take: a Matryoshka model's (config.json's matryoshka_dimensions, or every
    # width up to output_size where it says is_matryoshka); empty: `dimensions` is refused
    dimensions: list[int] = msgspec.field(default_factory=list)
    is_any_dimension: bool = False  # is_matryoshka without a list: any width 1..output_size


@functools.cache
def _field_types() -> dict[str, object]:
    hints = typing.get_type_hints(PoolingParams, include_extras=True)
    return {name: hints[name] for name in PoolingParams.__struct_fields__}
