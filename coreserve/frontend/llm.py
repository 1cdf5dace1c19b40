"""LLM: the offline, synchronous API with vLLM's names (frontend process). Its control verbs (RL:
update_weights, sleep, ...) are `LLMControlVerbs`' (coreserve/frontend/control_verbs.py), its pooling verbs
(embed, classify, score, ...) `LLMPoolingVerbs`' (coreserve/frontend/pooling_verbs.py)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from coreserve.frontend.clients.client_protocol import CoreClient
from coreserve.frontend.control_verbs import LLMControlVerbs
from coreserve.frontend.engine.chat_template import ChatRenderer
from coreserve.frontend.engine.engine import FrontendEngine
from coreserve.frontend.engine.input_processor import InputProcessor, PromptType
from coreserve.frontend.engine.output_processor import OutputProcessor
from coreserve.frontend.errors import EngineDeadError, RequestFailedError
from coreserve.frontend.lora import LoRARequest, lora_per_prompt, with_lora
from coreserve.frontend.outputs import RequestOutput
from coreserve.frontend.pooling_verbs import LLMPoolingVerbs
from coreserve.frontend.request_ids import request_id_of
from coreserve.protocol.messages import EngineStats
from coreserve.protocol.sampling_params import SamplingParams

OUTPUT_POLL_S = 0.05


class LLM(LLMControlVerbs, LLMPoolingVerbs):
    """`LLM(model=None, **engine_args)`: None is the built-in tiny model; `core_address` attaches to a
    running `python -m coreserve.engine_core` daemon instead of spawning a core (a list: several daemons of the
    same model, requests spread over them); `multiprocess=False` runs the core in this process.
    `runner="pooling"`: embed, classify, reward, encode and score (coreserve/frontend/pooling_verbs.py)
    instead of generate."""

    def __init__(
        self,
        model: str | None = None,
        *,
        multiprocess: bool = True,
        core_address: str | list[str] | None = None,
        **engine_args,
    ) -> None:
        self.engine = FrontendEngine.build(
            model, multiprocess=multiprocess, core_address=core_address, engine_args=engine_args
        )
        self.config, self.tokenizer, self.facts = self.engine.config, self.engine.tokenizer, self.engine.facts
        self._ids = itertools.count()

    @property
    def client(self) -> CoreClient:
        return self.engine.client

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.inputs

    @property
    def output_processor(self) -> OutputProcessor:
        return self.engine.outputs

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Completions in input order. All prompts are checked before any is sent, and sent together.
        `lora_request`: the adapter of every prompt, or one a prompt (docs/lora.md)."""
        prompts = _as_list(prompts)
        if sampling_params is None:  # as vLLM: the model's generation_config.json defaults
            sampling_params = self.get_default_sampling_params()
        params = _params_per_prompt(sampling_params, len(prompts))
        loras = lora_per_prompt(lora_request, len(prompts))
        params = [with_lora(p, lora, self.engine.request_adapter_folder) for p, lora in zip(params, loras)]
        requests = [
            self.engine.prepare(str(next(self._ids)), prompt, p) for prompt, p in zip(prompts, params)
        ]
        self.engine.add_requests(requests)
        return self._run([r.request_id for r in requests], use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens as max_tokens); vLLM's own defaults elsewhere.
        `generate` uses them when given no SamplingParams; given some, it uses those as they are."""
        return self.engine.get_default_sampling_params()

    def chat(
        self,
        messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the chat template (the given one, else the tokenizer's) and
        generates from it. A template that writes the BOS itself gets no second one from tokenizing.
        `lora_request`: as `generate`'s. `tools` (OpenAI's {"type": "function", "function": {...}}) and
        `chat_template_kwargs` (`enable_thinking`, ...) go to the template, as vLLM's do; the calls in the
        output are text here (the server parses them: docs/serving.md)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        renderer = ChatRenderer(self.tokenizer, self.engine.templates, chat_template)  # the server's renderer
        texts = [renderer.render(c, add_generation_prompt, tools, chat_template_kwargs) for c in conversations]
        prompts = [{"prompt_token_ids": renderer.prompt_token_ids(text)} for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
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
                    processed = self.engine.step(OUTPUT_POLL_S)
                    errors.update(processed.errors)
                    num_before = len(finished)
                    finished.update({r.request_id: r for r in processed.outputs if r.finished})
                    finished.update(dict.fromkeys(processed.errors))  # failed: no output to return
                    if len(finished) > num_before:  # update(0) would redraw (a new 0% line when not a tty)
                        bar.update(len(finished) - num_before)
            except BaseException:  # KeyboardInterrupt or a dead core: leave nothing running
                for request_id in request_ids:
                    if request_id not in finished:
                        self.engine.abort(request_id)
                raise
        if errors:  # the others finished normally; nothing of the failed ones is left in the engine
            request_id, error = next(iter(errors.items()))
            kind = EngineDeadError if isinstance(error, EngineDeadError) else RequestFailedError
            raise kind(
                f"{len(errors)} of {len(request_ids)} requests failed; prompt "
                f"{request_ids.index(request_id)}: {error}"
            ) from error
        outputs = [finished[request_id] for request_id in request_ids]
        for output in outputs:  # keyed by submission id until here; the user sees the request id
            output.request_id = request_id_of(output.request_id)
        return outputs

    def get_engine_stats(self) -> EngineStats:
        """The engine core's state, engine-wide (a daemon's other clients included): running and
        waiting requests, free and total KV blocks, preemptions and heap releases so far. Taken by the core after all
        this LLM sent before (so after the aborts of its finished requests), between two steps. At
        idle every block is free. Like generate, not to be called from two threads at once."""
        return self.engine.get_stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


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
