"""The pooling routes' request bodies, in vLLM's shapes (frontend process, HTTP server): `/v1/embeddings`
(OpenAI's, with vLLM's extras), `/pooling`, `/classify`, vLLM's pooling `/score` (`text_1`, `text_2`) and
`/rerank` (`query`, `documents`, `top_n`). Strict types from common/fields.py: an unknown field is a 400
naming it (vLLM's fields coreserve does not build among them: chat `messages`, `padding`, `embed_dtype`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from coreserve.frontend.server.common.fields import INT64_MAX, Int64, StrictBody, Text

Ids = list[Int64]
Input = Text | list[Text] | Ids | list[Ids]  # OpenAI's forms: a text, texts, token ids, lists of token ids
Truncation = Annotated[int, Field(ge=-1, le=INT64_MAX)] | None
Priority = Annotated[int, Field(ge=0, le=0)]  # no priorities here: only the default


class PoolingBody(StrictBody):
    """What every pooling body shares (vLLM's PoolingBasicRequestMixin, the fields built)."""

    model: str | None = None
    user: str | None = None  # OpenAI's end-user id: kept by no one here, as vLLM
    truncate_prompt_tokens: Truncation = None
    priority: Priority = 0
    request_id: str | None = None
    use_activation: bool | None = None  # embed: L2-normalize; classify: softmax or sigmoid (None: the model's)


class EmbeddingRequest(PoolingBody):
    input: Input
    encoding_format: Literal["float", "base64"] = "float"  # base64: the float32 little-endian bytes
    dimensions: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    add_special_tokens: bool = True


class PoolingRequest(EmbeddingRequest):
    task: Literal["embed", "classify"] | None = None  # None: the model's own


class ClassificationRequest(PoolingBody):
    input: Input
    add_special_tokens: bool = True


class ScoreRequest(PoolingBody):
    """vLLM's pooling score: text_1 against each text_2 (one text_1), or pair by pair."""

    text_1: Text | list[Text]
    text_2: Text | list[Text]


class RerankRequest(PoolingBody):
    """vLLM's (and Jina's) rerank: the documents by their score against the query, best first."""

    query: Text
    documents: list[Text]
    top_n: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0  # 0: every document
