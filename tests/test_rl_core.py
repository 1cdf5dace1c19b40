"""The core's RL control (coreserve/engine_core/rl_control.py, the runner's control verbs in coreserve/worker/runner_control.py) on the built-in model,
in process: weights updated in place equal HF's forward on those weights, a bad update leaves the old
ones serving, pause/resume, sleep/wake and prefix-cache resets, with the real model and no sockets."""

from __future__ import annotations

import pytest
import torch
from conftest import HF_TOLERANCE, load_hf
from safetensors.torch import save_file

from coreserve.engine_core.core import EngineCore
from coreserve.protocol.config import EngineConfig
from coreserve.protocol.messages import (
    ControlCall,
    ControlReply,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from coreserve.protocol.sampling_params import SamplingParams

PROMPT = [464, 3139, 286, 4881, 318, 6342, 13, 383, 3139, 286, 4486, 318, 11307, 13, 383, 3139, 286]


class Harness:
    """An EngineCore stepped by hand; control replies and outputs collected as the server would send them."""

    def __init__(self, path: str, **config) -> None:
        self.core = EngineCore(EngineConfig(model=path, num_kv_blocks=64, **config))
        self.replies: list[ControlReply] = []
        self.outputs: list = []
        self.nonce = 0

    def outbox(self, client: bytes, message) -> None:
        if isinstance(message, ControlReply):
            self.replies.append(message)
        else:
            assert isinstance(message, EngineCoreOutputs)
            self.outputs.extend(message.outputs)

    def command(self, verb: str, **kwargs) -> None:
        self.nonce += 1
        self.core.control.submit(b"", ControlCall(self.nonce, verb, kwargs), self.outbox)

    def add(self, req_id: str, params: SamplingParams, prompt: list[int] = PROMPT) -> None:
        refusal = self.core.add_request(b"", EngineCoreRequest(req_id, prompt, params, 0.0))
        assert refusal is None

    def step(self) -> None:
        if self.core.has_unfinished_requests():
            for batch in self.core.step().values():
                self.outputs.extend(batch.outputs)
        self.core.control.poll(self.outbox)

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            self.step()
            if not self.core.has_unfinished_requests() and not self.core.control.pending:
                return

    def of(self, req_id: str) -> list:
        return [o for o in self.outputs if o.req_id == req_id]


SCORE = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, prompt_logprobs=0)


def prompt_logprobs(harness: Harness, req_id: str) -> torch.Tensor:
    harness.add(req_id, SCORE)
    harness.run()
    first = harness.of(req_id)[0]
    return torch.from_numpy(first.prompt_logprobs.logprobs_np()[:, 0].copy())


def hf_prompt_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1))[:, 0]


def perturbed_state(model, scale: float, seed: int, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The HF model's parameters (in place) plus noise, by HF name; `names`: only those."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if names is None or name in names:
                param.add_(torch.randn(param.shape, generator=gen) * scale * param.abs().mean())
                state[name] = param.detach().clone().contiguous()
    return state


@pytest.fixture
def harness(tiny_path):
    harness = Harness(tiny_path)
    yield harness
    harness.core.close()


def test_an_update_loads_in_place_and_its_logprobs_equal_hfs_on_the_new_weights(harness, tiny_path, tmp_path):
    hf = load_hf(tiny_path)
    before = prompt_logprobs(harness, "before")
    assert torch.allclose(before, hf_prompt_logprobs(hf), atol=HF_TOLERANCE)
    embed = harness.core.executor.model.embed_tokens.weight
    address = embed.data_ptr()
    save_file(perturbed_state(hf, 0.2, seed=1), str(tmp_path / "w.safetensors"))
    harness.command("update_weights", path=str(tmp_path / "w.safetensors"))
    assert harness.replies[-1].error is None and harness.replies[-1].weight_version == 1
    after = prompt_logprobs(harness, "after")
    assert embed.data_ptr() == address  # in place
    assert (after - before).abs().max() > 1e-2
    assert torch.allclose(after, hf_prompt_logprobs(hf), atol=HF_TOLERANCE)
    assert all(o.weight_version == 1 for o in harness.of("after"))
    assert all(o.weight_version == 0 for o in harness.of("before"))


def test_a_partial_update_changes_only_the_named_tensors(harness, tiny_path, tmp_path):
    hf = load_hf(tiny_path)
    names = {"model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    save_file(perturbed_state(hf, 0.5, seed=2, names=names), str(tmp_path / "part.safetensors"))
    harness.command("update_weights", path=str(tmp_path / "part.safetensors"))
    assert harness.replies[-1].error is None
    assert torch.allclose(prompt_logprobs(harness, "p"), hf_prompt_logprobs(hf), atol=HF_TOLERANCE)


@pytest.mark.parametrize(
    "bad", [{"model.layers.0.mlp.up_proj.weight": (3, 3)}, {"model.layers.0.mlp.nonsense.weight": (4,)}]
)
def test_a_mismatched_update_is_refused_by_name_and_the_old_weights_keep_serving(
    harness, tiny_path, tmp_path, bad
):
    hf = load_hf(tiny_path)
    before = prompt_logprobs(harness, "before")
    state = perturbed_state(hf, 0.5, seed=3)  # good tensors first: none of them may land
    state.update({name: torch.ones(shape) for name, shape in bad.items()})
    save_file(state, str(tmp_path / "bad.safetensors"))
    harness.command("update_weights", path=str(tmp_path / "bad.safetensors"))
    reply = harness.replies[-1]
    assert reply.error is not None and next(iter(bad)) in reply.error and reply.weight_version == 0
    assert torch.equal(prompt_logprobs(harness, "after"), before)


def test_an_update_in_wait_mode_lets_running_requests_finish_on_the_old_weights(harness, tiny_path, tmp_path):
    hf = load_hf(tiny_path)
    save_file(perturbed_state(hf, 0.3, seed=4), str(tmp_path / "w.safetensors"))
    harness.add("old", SamplingParams(temperature=0.0, max_tokens=6, logprobs=0))
    harness.step()
    harness.command("update_weights", path=str(tmp_path / "w.safetensors"), mode="wait")
    harness.add("new", SamplingParams(temperature=0.0, max_tokens=2))  # sent during the drain: it waits
    assert not harness.replies
    harness.run()
    assert harness.replies[-1].error is None
    old, new = harness.of("old"), harness.of("new")
    assert sum(len(o.new_token_ids) for o in old) == 6 and all(o.weight_version == 0 for o in old)
    assert new and all(o.weight_version == 1 for o in new)


def test_pause_abort_finishes_requests_as_aborted_and_new_ones_wait_for_resume(harness):
    harness.add("a", SamplingParams(temperature=0.0, max_tokens=50))
    harness.step()
    harness.command("pause_generation", mode="abort")
    assert harness.replies[-1].is_paused and harness.of("a")[-1].finish_reason == FinishReason.ABORT
    harness.add("b", SamplingParams(temperature=0.0, max_tokens=3))
    for _ in range(5):
        harness.step()
    assert not harness.of("b") and not harness.core.has_unfinished_requests()
    harness.command("resume_generation")
    harness.run()
    assert harness.of("b")[-1].finish_reason == FinishReason.LENGTH


def test_pause_keep_freezes_running_requests_and_resume_continues_them_unchanged(harness):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    harness.add("ref", greedy)
    harness.run()
    harness.add("kept", greedy)
    harness.step()
    harness.step()
    harness.command("pause_generation", mode="keep")
    num_before = len(harness.of("kept"))
    for _ in range(5):
        harness.step()
    assert len(harness.of("kept")) == num_before
    harness.command("resume_generation")
    harness.run()
    tokens = lambda req_id: [t for o in harness.of(req_id) for t in o.new_token_ids]  # noqa: E731
    assert tokens("kept") == tokens("ref")


def test_sleep_frees_the_kv_cache_and_requests_sent_meanwhile_run_after_wake(harness):
    reference = SamplingParams(temperature=0.0, max_tokens=5, logprobs=0)
    harness.add("ref", reference)
    harness.run()
    harness.command("sleep", level=1)
    assert harness.replies[-1].sleep_level == 1 and harness.core.executor.kv.caches == []
    harness.add("later", reference)
    for _ in range(3):
        harness.step()
    assert not harness.of("later")
    harness.command("wake_up")
    assert harness.replies[-1].sleep_level == 0
    harness.run()
    ref, later = harness.of("ref"), harness.of("later")
    assert [t for o in later for t in o.new_token_ids] == [t for o in ref for t in o.new_token_ids]
    assert harness.core.kv_cache.num_free_blocks == harness.core.num_kv_blocks


def test_sleep_level_2_drops_the_weights_and_wake_needs_a_checkpoint(harness, tiny_path):
    before = prompt_logprobs(harness, "before")
    harness.command("sleep", level=2)
    assert harness.replies[-1].sleep_level == 2
    assert harness.core.executor.model.layers[0].qkv_proj.weight.numel() == 0
    harness.command("wake_up")
    assert "checkpoint" in harness.replies[-1].error and harness.replies[-1].sleep_level == 2
    harness.command("wake_up", path=tiny_path)
    assert harness.replies[-1].error is None and harness.replies[-1].sleep_level == 0
    assert torch.allclose(prompt_logprobs(harness, "after"), before, atol=1e-6)


def test_wake_up_with_a_checkpoint_while_awake_forgets_the_old_weights_kv(harness, tiny_path, tmp_path):
    """New weights through wake_up on an engine whose KV cache never slept: the cached prefixes were
    computed with the old weights, so they are forgotten (a request after it reads none, and its
    logprobs are HF's on the new weights)."""
    hf = load_hf(tiny_path)
    prompt_logprobs(harness, "before")
    assert harness.core.kv_cache.num_cached_blocks > 0
    save_file(perturbed_state(hf, 0.2, seed=3), str(tmp_path / "w.safetensors"))
    harness.command("wake_up", tags=["weights"], path=str(tmp_path / "w.safetensors"))
    assert harness.replies[-1].error is None and harness.core.kv_cache.num_cached_blocks == 0
    after = prompt_logprobs(harness, "after")
    assert harness.of("after")[0].num_cached_tokens == 0
    assert torch.allclose(after, hf_prompt_logprobs(hf), atol=HF_TOLERANCE)


def test_reset_prefix_cache_forgets_every_cached_block(harness):
    harness.add("a", SamplingParams(temperature=0.0, max_tokens=2))
    harness.run()
    assert harness.core.kv_cache.num_cached_blocks > 0
    harness.command("reset_prefix_cache")
    assert harness.core.kv_cache.num_cached_blocks == 0
    assert harness.core.kv_cache.num_free_blocks == harness.core.num_kv_blocks
    harness.add("b", SamplingParams(temperature=0.0, max_tokens=2))
    harness.run()
    assert harness.of("b")[0].num_cached_tokens == 0


def test_an_unknown_verb_or_arguments_that_do_not_fit_are_refused_and_nothing_changes(harness):
    harness.command("format_disk")
    assert "unknown control verb 'format_disk'" in harness.replies[-1].error
    harness.command("sleep", level=3)
    assert harness.replies[-1].error.startswith("sleep: Expected `int` <= 2")
    harness.command("sleep", levels=1)
    assert "unknown field `levels`" in harness.replies[-1].error
    assert harness.replies[-1].sleep_level == 0 and harness.core.executor.kv.caches


def test_a_new_verb_is_a_runner_method_and_a_row_in_each_table(harness, monkeypatch):
    """What a new verb reaching the model takes below the frontend (docs/architecture.md lists the
    files): a method the runner's table names and a row of the core's table; its result comes back."""
    import msgspec

    from coreserve.engine_core import rl_control
    from coreserve.worker import runner_control

    class ScaleArgs(rl_control.Args):
        factor: float

    def num_blocks_times(control, factor: float) -> float:  # control: the runner's RunnerControl
        return control.kv.num_blocks * factor

    monkeypatch.setitem(runner_control.RUNNER_VERBS, "num_blocks_times", runner_control.RunnerVerb(num_blocks_times, False))
    monkeypatch.setitem(rl_control.VERBS, "num_blocks_times", rl_control.Verb(ScaleArgs, rl_control.on_runner("num_blocks_times")))
    harness.command("num_blocks_times", factor=0.5)
    assert harness.replies[-1].error is None
    assert harness.replies[-1].result == harness.core.num_kv_blocks * 0.5
    reply = msgspec.msgpack.decode(msgspec.msgpack.encode(harness.replies[-1]), type=ControlReply)
    assert reply.result == harness.core.num_kv_blocks * 0.5
