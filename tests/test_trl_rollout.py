"""TRL's GRPOTrainer with coreserve as its rollout engine (examples/trl_grpo_rollout.py) in a subprocess,
on the CPU: two training steps ran, the rollouts of step 2 came from the weights after step 1, the
engine's version advanced with each sync, every rollout logprob is finite, and after the last sync the
engine's logprobs equal the trained model's own forward (fp32); and with a PEFT adapter trained and
synced alone. Skipped only where trl is not installed (it is in the test extras)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import IS_BF16_MODE
from server_harness import REPO

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[test]' brings trl==1.16.0)")

pytestmark = pytest.mark.slow


def run_example(*flags: str) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    done = subprocess.run(
        [sys.executable, "examples/trl_grpo_rollout.py", "--steps", "2", *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_grpo_trainer_runs_two_steps_with_coreserve_rollouts():
    result = run_example()
    assert result["global_step"] == 2 and len(result["losses"]) == 2
    assert all(norm > 0 for norm in result["grad_norms"])  # the toy reward varied: each step moved weights
    assert result["rollout_weight_versions"] == [0, 1]  # step 2's rollouts ran on step 1's weights
    assert result["weight_version"] == 2  # and the final sync after step 2
    assert result["num_logprobs"] == 2 * 4 * 8  # two rollouts of 4 completions of 8 tokens
    assert result["logprobs_finite"]
    if not IS_BF16_MODE:
        assert result["policy_gap"] < 1e-4


def test_grpo_with_peft_syncs_the_adapter_alone_and_its_logprobs_are_peft_s():
    """TRL's GRPO with a PEFT LoRA adapter: after step 1 the adapter alone is saved and loaded into the
    engine (in place after the first time, the weight version moving), step 2's rollouts name it, and
    after the last sync the engine's logprobs with the adapter equal the PEFT model's own forward."""
    result = run_example("--peft")
    assert result["global_step"] == 2 and all(norm > 0 for norm in result["grad_norms"])
    assert result["rollout_adapters"] == [None, "policy"]  # step 1 on the base (B = 0), step 2 on the adapter
    assert result["weight_version"] == 1  # the final sync loaded the adapter in place
    assert result["num_logprobs"] == 2 * 4 * 8 and result["logprobs_finite"]
    if not IS_BF16_MODE:
        assert result["policy_gap"] < 1e-4
