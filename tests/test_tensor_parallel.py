"""Tensor parallelism (coreserve/worker/parallel/executor.py, coreserve/worker/parallel/rank.py, coreserve/worker/models/sharding.py):
`tensor_parallel_size=2` on the CPU, two gloo ranks of one thread each, gives `tensor_parallel_size=1`'s
greedy tokens and its logprobs within 1e-4, in process and as a daemon; a dead rank stops the engine
with an error instead of a hang."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

from coreserve import LLM
from coreserve.frontend.errors import EngineDeadError
from coreserve.protocol.sampling_params import SamplingParams
from coreserve.protocol.structured_outputs import StructuredOutputsParams
from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.loader import read_config
from coreserve.worker.models.sharding import Shard, rank_lora_pair, rank_part, shard_args
from tests.conftest import BATCH_SHAPE_TOLERANCE, PROMPTS, assert_same_positions, running_daemon

TP2 = dict(tensor_parallel_size=2, num_threads=1)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, prompt_logprobs=3)
TOLERANCE = BATCH_SHAPE_TOLERANCE or 1e-4  # bf16 mode: the sums in another order, then bf16 rounding


def assert_same_outputs(expected, actual) -> None:
    """Greedy tokens identical; each position's candidates the same tokens, ranks and logprobs (1e-4)
    (the sums over ranks add in another order: the last bits differ)."""
    assert len(expected) == len(actual)
    for want, got in zip(expected, actual):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        rows = list(zip(want.outputs[0].logprobs, got.outputs[0].logprobs))
        rows += list(zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:]))
        for want_row, got_row in rows:
            if BATCH_SHAPE_TOLERANCE:  # bf16 mode: near-ties may swap (conftest.assert_same_positions)
                assert_same_positions([got_row], [want_row], TOLERANCE)
                continue
            assert set(got_row) == set(want_row)
            for token_id, logprob in want_row.items():
                # a prompt token deep in the tail may swap places with a neighbour as close as rounding
                slack = 0 if logprob.rank <= len(want_row) else 2
                assert abs(got_row[token_id].rank - logprob.rank) <= slack
                assert abs(got_row[token_id].logprob - logprob.logprob) <= TOLERANCE


@pytest.fixture(scope="module")
def tp1_outputs(tiny_path):
    with LLM(tiny_path, multiprocess=False, num_threads=1) as llm:
        return llm.generate(PROMPTS[:8], PARAMS)


def test_shard_args_split_heads_and_columns_and_refuse_uneven_counts(tiny_path):
    args = DecoderArgs.from_hf_config(read_config(tiny_path))
    half = shard_args(args, 2)
    assert (half.num_heads, half.num_kv_heads) == (args.num_heads // 2, args.num_kv_heads // 2)
    assert half.intermediate_size == args.intermediate_size // 2 and half.hidden_size == args.hidden_size
    with pytest.raises(ValueError, match="num_key_value_heads"):
        shard_args(args, args.num_kv_heads + 1)


def test_rank_parts_split_outputs_by_rows_inputs_by_columns_and_add_the_o_bias_once():
    weight = torch.arange(24.0).reshape(4, 6)
    first, second = Shard(0, 2), Shard(1, 2)
    q_name, o_name = "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([rank_part(q_name, weight, s) for s in (first, second)]), weight)
    assert torch.equal(torch.cat([rank_part(o_name, weight, s) for s in (first, second)], dim=1), weight)
    bias = torch.ones(6)
    o_bias = "model.layers.0.self_attn.o_proj.bias"
    assert torch.equal(rank_part(o_bias, bias, first) + rank_part(o_bias, bias, second), bias)


def test_a_lora_pair_splits_as_its_module_and_the_ranks_deltas_make_the_whole():
    """A q/k/v B by rows (a fused qkv_proj's q, k and v each split, so a rank holds its heads of each), an
    o/down A by columns (the ranks' partial deltas sum to the whole), an lm_head pair whole."""
    gen = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(3, 8, generator=gen), torch.randn(2, 8, generator=gen), torch.randn(8, 2, generator=gen)
    halves = [rank_lora_pair("model.layers.1.self_attn.qkv_proj", a, b, (4, 2, 2), Shard(r, 2)) for r in (0, 1)]
    rows_of_rank = [[0, 1, 4, 6], [2, 3, 5, 7]]  # q's first or second half, then k's and v's
    assert all(torch.equal(ra, a) and torch.equal(rb, b[rows]) for (ra, rb), rows in zip(halves, rows_of_rank))
    b = torch.randn(5, 2, generator=gen)
    halves = [rank_lora_pair("model.layers.1.mlp.down_proj", a, b, (5,), Shard(r, 2)) for r in (0, 1)]
    partial = [x[:, 4 * r: 4 * r + 4] @ ra.T @ rb.T for r, (ra, rb) in enumerate(halves)]
    torch.testing.assert_close(partial[0] + partial[1], x @ a.T @ b.T)
    assert all(t is u for t, u in zip(rank_lora_pair("lm_head", a, b, (5,), Shard(1, 2)), (a, b)))


def test_two_ranks_equal_one_in_process_with_multi_step(tiny_path, tp1_outputs):
    with LLM(tiny_path, multiprocess=False, num_scheduler_steps=3, **TP2) as llm:
        runner = llm.client.core.executor
        assert [proc.poll() for proc in runner.procs] == [None, None]  # two live worker processes
        procs = list(runner.procs)
        assert_same_outputs(tp1_outputs, llm.generate(PROMPTS[:8], PARAMS))
    assert all(proc.poll() is not None for proc in procs)  # stopped with the engine


# biases, q/k norms, sandwich norms; Exaone 4's norms on the outputs only (after the sum over ranks), NoPE layer
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2", "gemma3", "exaone4"])
def test_two_ranks_equal_one_for_model_families(family, family_model):
    path = family_model(family)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2)
    with LLM(path, multiprocess=False, num_threads=1) as llm:
        expected = llm.generate(PROMPTS[:3], params)
    with LLM(path, multiprocess=False, **TP2) as llm:
        assert_same_outputs(expected, llm.generate(PROMPTS[:3], params))


def test_two_ranks_carry_a_grammars_constraint_masses(tiny_path):
    """Rank 0's output crosses to the core as a message: the masses each grammar allowed crossed too
    (before: dropped on the way, so constraint_mass was empty under tensor parallelism)."""
    grammar = StructuredOutputsParams(regex="( the| of| and)+")
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, structured_outputs=grammar)
    with LLM(tiny_path, multiprocess=False, num_threads=1) as one:
        expected = one.generate(PROMPTS[:2], params, use_tqdm=False)
    with LLM(tiny_path, multiprocess=False, **TP2) as two:
        actual = two.generate(PROMPTS[:2], params, use_tqdm=False)
    for want, got in zip(expected, actual):
        masses = want.outputs[0].constraint_masses
        assert masses and len(masses) == len(want.outputs[0].token_ids) and all(0 < m <= 1 for m in masses)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].constraint_masses == pytest.approx(masses, rel=1e-5)


def daemon_address() -> str:
    return f"ipc:///tmp/coreserve-test-tp-{uuid.uuid4().hex[:8]}/core"


def test_a_tensor_parallel_daemon_equals_one_core(tiny_path, tp1_outputs):
    address = daemon_address()
    with running_daemon(tiny_path, address, "--tensor-parallel-size", "2", "--num-threads", "1"):
        with LLM(core_address=address) as llm:
            assert_same_outputs(tp1_outputs, llm.generate(PROMPTS[:8], PARAMS))


def test_a_dead_rank_stops_the_daemon_with_an_error_not_a_hang(tiny_path):
    from tests.conftest import start_daemon

    address = daemon_address()
    daemon = start_daemon(tiny_path, address, "--tensor-parallel-size", "2", "--num-threads", "1")
    try:
        with LLM(core_address=address) as llm:
            assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
            workers = child_pids(daemon.pid)
            assert len(workers) == 2
            os.kill(workers[-1], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                llm.generate(PROMPTS[:4], SamplingParams(max_tokens=50))
            assert time.monotonic() - start < 30
        assert daemon.wait(timeout=30) != 0  # the core stopped, saying why, and took rank 0 with it
        time.sleep(0.5)
        assert not any(Path(f"/proc/{pid}").exists() and not is_zombie(pid) for pid in workers)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


def child_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sorted(int(c) for c in children)


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
