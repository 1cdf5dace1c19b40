"""LLM: the offline, synchronous API with vLLM's names (frontend process)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from frontend.chat_template import render_chat
from frontend.engine_parts import build_engine_parts
from frontend.errors import EngineDeadError, RequestFailedError
from frontend.input_processor import PromptType
from frontend.outputs import RequestOutput
from protocol.messages import EngineStats
from protocol.model_facts import generation_defaults
from protocol.sampling_params import SamplingParams

OUTPUT_POLL_S = 0.05


class LLM:
    """`LLM(model=None, **engine_args)`: None is the built-in tiny model; `core_address` attaches to a
    running `python -m engine_core` daemon instead of spawning a core (a list: several daemons of the
    same model, requests spread over them); `multiprocess=False` runs the core in this process."""

    def __init__(
        self,
        model: str | None = None,
        *,
        multiprocess: bool = True,
        core_address: str | list[str] | None = None,
        **engine_args,
    ) -> None:
        parts = build_engine_parts(model, multiprocess, core_address, engine_args)
        self.config, self.tokenizer, self.client = parts.config, parts.tokenizer, parts.client
        self.facts = self.client.facts
        self.input_processor, self.output_processor = parts.inputs, parts.outputs
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Completions in input order. All prompts are validated before any is sent."""
        prompts = _as_list(prompts)
        if sampling_params is None:  # as vLLM: the model's generation_config.json defaults
            sampling_params = self.get_default_sampling_params()
        params = _params_per_prompt(sampling_params, len(prompts))
        requests = []
        for prompt, p in zip(prompts, params):
            text, token_ids = self.input_processor.process(prompt, p)
            requests.append((str(next(self._ids)), text, token_ids, p))
        request_ids = [r[0] for r in requests]
        try:
            core_requests = []
            for request_id, text, token_ids, p in requests:
                for core_id, child in self.output_processor.add_request(request_id, text, token_ids, p):
                    core_requests.append(self.input_processor.make_request(core_id, token_ids, child))
            self.client.send(core_requests)
        except BaseException:  # nothing of this call may stay behind in the output processor
            for request_id in request_ids:
                self.output_processor.abort(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens as max_tokens); vLLM's own defaults elsewhere.
        `generate` uses them when given no SamplingParams; given some, it uses those as they are."""
        return SamplingParams(**generation_defaults(self.config.model))

    def chat(
        self,
        messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Renders each conversation with the chat template (the given one, else the tokenizer's) and
        generates from it. A template that writes the BOS itself gets no second one from tokenizing."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        texts = [render_chat(self.tokenizer, c, chat_template, add_generation_prompt) for c in conversations]
        prompts = [{"prompt_token_ids": chat_prompt_token_ids(self.tokenizer, text)} for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput | None] = {}
        errors: dict[str, Exception] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while len(finished) < len(request_ids):
                    outputs = self.client.get_outputs(OUTPUT_POLL_S)
                    processed = self.output_processor.process(outputs, self.client.take_lost())
                    self.client.abort(processed.to_abort)
                    errors.update(processed.errors)
                    num_before = len(finished)
                    finished.update({r.request_id: r for r in processed.outputs if r.finished})
                    finished.update(dict.fromkeys(processed.errors))  # failed: no output to return
                    if len(finished) > num_before:  # update(0) would redraw (a new 0% line when not a tty)
                        bar.update(len(finished) - num_before)
            except BaseException:  # KeyboardInterrupt or a dead core: leave nothing running
                for request_id in request_ids:
                    if request_id not in finished:
                        self.client.abort(self.output_processor.abort(request_id)[0])
                raise
        if errors:  # the others finished normally; nothing of the failed ones is left in the engine
            request_id, error = next(iter(errors.items()))
            kind = EngineDeadError if isinstance(error, EngineDeadError) else RequestFailedError
            raise kind(
                f"{len(errors)} of {len(request_ids)} requests failed; prompt "
                f"{request_ids.index(request_id)}: {error}"
            ) from error
        return [finished[request_id] for request_id in request_ids]

    def get_engine_stats(self) -> EngineStats:
        """The engine core's state, engine-wide (a daemon's other clients included): running and
        waiting requests, free and total KV blocks, preemptions so far. Taken by the core after all
        this LLM sent before (so after the aborts of its finished requests), between two steps. At
        idle every block is free. Like generate, not to be called from two threads at once."""
        return self.client.get_stats()

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


def chat_prompt_token_ids(tokenizer, text: str) -> list[int]:
    """The rendered chat's token ids: special tokens added only when the template did not write the BOS."""
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = bool(bos) and text.startswith(bos)
    return list(tokenizer(text, add_special_tokens=not has_bos).input_ids)


def _as_list(prompts) -> list:
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    if isinstance(prompts, dict):
        return [prompts]
    return list(prompts)


def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    return params
