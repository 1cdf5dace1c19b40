"""Bad input is a ValueError for that request alone; a dead core is an EngineDeadError within 2 s."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import PROMPTS, free_blocks_are_all

from coreserve import LLM, EngineDeadError, SamplingParams

OK = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", OK, "empty"),
        ([[]], OK, "empty"),
        ([1, 2, 60000], OK, "out of vocabulary"),
        ([-1, 5], OK, "greater than or equal to 0"),
        ("word " * 3000, OK, "max_model_len"),
        (PROMPTS[0], SamplingParams(logprobs=21), "max_logprobs=20"),
        (PROMPTS[0], SamplingParams(prompt_logprobs=-1), "max_logprobs=20"),
        (PROMPTS[0], SamplingParams(stop_token_ids=[99999]), "out of vocabulary"),
    ],
)
def test_bad_input_raises_value_error_and_the_next_request_succeeds(llm_mp, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm_mp.generate(prompt, params, use_tqdm=False)
    assert len(llm_mp.generate(PROMPTS[0], OK, use_tqdm=False)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_k=-5),
        dict(max_tokens=0),
        dict(n=0),
        dict(min_tokens=5, max_tokens=2),
        dict(repetition_penalty=0.0),
        dict(logprobs=-2),
        dict(stop=[""]),
    ],
)
def test_invalid_sampling_values_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_a_bad_prompt_in_a_batch_sends_nothing(llm_inproc):
    with pytest.raises(ValueError, match="empty"):
        llm_inproc.generate([PROMPTS[0], ""], OK, use_tqdm=False)
    assert not llm_inproc.client.core.has_unfinished_requests()
    assert free_blocks_are_all(llm_inproc)


@pytest.mark.parametrize(
    "engine_args, field",
    [
        ({"dtype": "fp16"}, "dtype"),
        ({"num_scheduler_steps": 2.5}, "num_scheduler_steps"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"can_use_cpu_kernels": "no"}, "can_use_cpu_kernels"),
        ({"num_threads": 0}, "num_threads"),
        ({"device": 0}, "device"),
    ],
)
def test_engine_argument_of_the_wrong_type_or_range_is_a_value_error_naming_it(engine_args, field):
    """Checked before any process starts: not a KeyError in the core, nor a core that dies at start."""
    with pytest.raises(ValueError, match=field):
        LLM(**engine_args)


def test_unknown_engine_argument_is_a_value_error():
    with pytest.raises(ValueError, match="max_num_sequences"):
        LLM(max_num_sequences=4)


def test_killing_the_core_raises_engine_dead_error_within_two_seconds(tiny_path):
    llm = LLM(tiny_path, num_kv_blocks=256)
    pid = llm.client.proc.pid
    killed_at = []

    def kill_soon() -> None:
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_soon).start()
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS * 4, params, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 2.0
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[0], OK, use_tqdm=False)
    tmpdir = llm.client.tmpdir
    llm.shutdown()
    assert not os.path.exists(tmpdir)


def test_shutdown_leaves_no_process_or_socket_file(tiny_path):
    llm = LLM(tiny_path, num_kv_blocks=64)
    proc, tmpdir = llm.client.proc, llm.client.tmpdir
    assert llm.generate(PROMPTS[0], OK, use_tqdm=False)[0].finished
    assert os.listdir(tmpdir)  # the ipc socket files exist while it runs
    llm.shutdown()
    assert proc.poll() is not None
    assert not os.path.exists(tmpdir)
    assert not [t for t in threading.enumerate() if t.name.startswith("core-")]


def test_a_frontend_too_busy_to_listen_does_not_declare_a_live_core_dead(tiny_path):
    """Heartbeats that wait unread in the socket prove the core alive: the frontend's own pause (a
    loaded machine, a long detokenization) is not the core's silence."""
    from coreserve.protocol.messages import EngineCoreRequest

    with LLM(tiny_path, num_kv_blocks=64) as llm:
        llm.client.dead_after_s = 1.0
        request = EngineCoreRequest("busy", [1, 2, 3], SamplingParams(max_tokens=2), time.time())
        llm.client.send([request])
        time.sleep(2.5)  # not listening, while the core answers and beats
        outputs = llm.client.get_outputs(0.5)
        while not any(o.finish_reason is not None for o in outputs):
            outputs = llm.client.get_outputs(0.5)
