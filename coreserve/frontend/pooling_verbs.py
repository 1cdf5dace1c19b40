"""LLM's pooling verbs with vLLM's names (frontend process): `embed`, `classify`, `reward`, `encode` and
`score`, over an engine with runner="pooling" (docs/serving.md, "Pooling"). Each prompt is one request whose
SamplingParams carry its PoolingParams to the core (`pooling_sampling_params`): its whole prompt in one step,
nothing sampled, its one output the pooled vector. `score` embeds both sides and takes their cosine (an
embedding model), or classifies each pair tokenized together (a cross-encoder: a classifier of one label).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from coreserve.frontend.engine.input_processor import PromptType
from coreserve.frontend.lora import LoRARequest
from coreserve.frontend.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from coreserve.protocol.pooling_params import UNBUILT_POOLING_TASKS, PoolingFacts, PoolingParams
from coreserve.protocol.sampling_params import SamplingParams

PoolingParamsArg = PoolingParams | Sequence[PoolingParams] | None
LoraArg = LoRARequest | Sequence[LoRARequest | None] | None


def pooling_sampling_params(pooling: PoolingParams | None, task: str) -> SamplingParams:
    """The SamplingParams that carry a pooling request to the core: one step, nothing sampled or decoded."""
    pooling = msgspec.structs.replace(pooling or PoolingParams(), task=task)
    return SamplingParams(max_tokens=1, detokenize=False, truncate_prompt_tokens=pooling.truncate_prompt_tokens,
                          pooling=pooling)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine of two embeddings, in float64 (vLLM's score of an embedding model)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))


class LLMPoolingVerbs:
    """Mixed into LLM, whose `generate` runs any SamplingParams (a pooling request's included)."""

    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParamsArg = None,
              lora_request: LoraArg = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`.outputs.embedding`), normalized unless the params say otherwise."""
        outputs = self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm, lora_request)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
                 pooling_params: PoolingParamsArg = None,
                 lora_request: LoraArg = None) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities (`.outputs.probs`; the raw logits with use_activation=False)."""
        outputs = self._pool(prompts, pooling_params, "classify", None, use_tqdm, lora_request)
        return [ClassificationRequestOutput.from_base(o) for o in outputs]

    def reward(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True, pooling_params: PoolingParamsArg = None,
               lora_request: LoraArg = None) -> list[PoolingRequestOutput]:
        """A reward model's score of each prompt (a *ForSequenceClassification's head, no activation: HF's
        logits at the last non-pad token), in `.outputs.data`."""
        given = pooling_params or PoolingParams(use_activation=False)
        return self._pool(prompts, given, "classify", truncate_prompt_tokens, use_tqdm, lora_request)

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParamsArg = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, lora_request: LoraArg = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """The pooled vector of each prompt under `pooling_task` (the model's own task where None)."""
        if pooling_task in UNBUILT_POOLING_TASKS:
            raise ValueError(f"pooling_task={pooling_task!r} (a vector a token, or a plugin's) is not built; "
                             "built: 'embed', 'classify'")
        task = pooling_task or self._pooling_facts().tasks[0]
        return self._pool(prompts, pooling_params, task, truncate_prompt_tokens, use_tqdm, lora_request)

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None,
              lora_request: LoraArg = None) -> list[ScoringRequestOutput]:
        """vLLM's: one score per pair (data_1 one text against each of data_2, or pair by pair)."""
        firsts, seconds = _score_lists(data_1, data_2)
        facts = self._pooling_facts()
        if facts.tasks == ["embed"]:
            outputs = self.embed([*firsts, *seconds], truncate_prompt_tokens=truncate_prompt_tokens,
                                 use_tqdm=use_tqdm, pooling_params=pooling_params, lora_request=lora_request)
            left, right = outputs[: len(firsts)], outputs[len(firsts) :]
            return [_scored(a, b) for a, b in zip(left * len(right) if len(left) == 1 else left, right)]
        if facts.output_size != 1:
            raise ValueError(f"score needs an embedding model or a cross-encoder (a classifier of one label); "
                             f"this classifier has {facts.output_size} labels")
        firsts = firsts * len(seconds) if len(firsts) == 1 else firsts
        pairs = [self._pair_prompt(a, b, truncate_prompt_tokens) for a, b in zip(firsts, seconds)]
        outputs = self._pool(pairs, pooling_params, "classify", None, use_tqdm, lora_request)
        return [ScoringRequestOutput.from_base(o) for o in outputs]

    def _pool(self, prompts, pooling_params: PoolingParamsArg, task: str, truncate_prompt_tokens: int | None,
              use_tqdm: bool, lora_request: LoraArg) -> list[PoolingRequestOutput]:
        prompts = [prompts] if isinstance(prompts, (str, dict)) or _is_token_list(prompts) else list(prompts)
        given = pooling_params if isinstance(pooling_params, Sequence) else [pooling_params] * len(prompts)
        if len(given) != len(prompts):
            raise ValueError(f"got {len(given)} PoolingParams for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            given = [msgspec.structs.replace(p or PoolingParams(), truncate_prompt_tokens=truncate_prompt_tokens)
                     for p in given]
        params = [pooling_sampling_params(p, task) for p in given]
        return self.generate(prompts, params, use_tqdm, lora_request)

    def _pair_prompt(self, first: str, second: str, truncate_prompt_tokens: int | None) -> dict:
        """A cross-encoder's input: the two texts tokenized together, as its tokenizer pairs them."""
        if not isinstance(first, str) or not isinstance(second, str):
            raise ValueError("score with a cross-encoder takes texts (token ids cannot be paired by its tokenizer)")
        token_ids = list(self.tokenizer(first, text_pair=second).input_ids)
        keep = truncate_prompt_tokens
        return {"prompt_token_ids": token_ids if keep is None or keep == -1 else token_ids[-keep:]}

    def _pooling_facts(self) -> PoolingFacts:
        facts = self.engine.facts.pooling
        if facts is None:
            raise ValueError("embed, classify, reward, encode and score need an engine with runner='pooling'; "
                             "this one generates")
        return facts


def _scored(first: EmbeddingRequestOutput, second: EmbeddingRequestOutput) -> ScoringRequestOutput:
    score = cosine(np.asarray(first.outputs.embedding), np.asarray(second.outputs.embedding))
    return ScoringRequestOutput(f"{first.request_id}_{second.request_id}", ScoringOutput(score),
                                first.prompt_token_ids + second.prompt_token_ids)


def _score_lists(data_1, data_2) -> tuple[list, list]:
    """vLLM's pairing: one first text against every second one, or as many of each, pair by pair."""
    firsts = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
    seconds = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
    if not seconds or len(firsts) not in (1, len(seconds)):
        raise ValueError(f"score pairs one text with each of data_2, or as many of each: got {len(firsts)} and "
                         f"{len(seconds)}")
    return firsts, seconds


def _is_token_list(prompts: object) -> bool:
    return isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
