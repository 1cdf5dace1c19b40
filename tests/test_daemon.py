"""The core as a daemon: several frontends attach to one `python -m engine_core`, each sees only its own
outputs; a frontend with another tokenizer is refused; the daemon outlives its clients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import PROMPTS, free_blocks_are_all, start_daemon

from frontend import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def daemon(tiny_path, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('daemon')}/core"
    proc = start_daemon(tiny_path, address, "--num-kv-blocks", "256", "--log-level", "WARNING")
    yield address
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def test_two_frontends_share_a_daemon_and_get_only_their_own_outputs(daemon, tiny_path, llm_inproc):
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    expected = {
        p: llm_inproc.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:4]
    }
    clients = [LLM(tiny_path, core_address=daemon) for _ in range(2)]
    results: dict[int, list] = {}

    def run(i: int) -> None:  # the same request ids ("0", "1") from both clients at the same time
        results[i] = clients[i].generate(PROMPTS[2 * i : 2 * i + 2], params, use_tqdm=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for i, outputs in results.items():
        assert [o.prompt for o in outputs] == PROMPTS[2 * i : 2 * i + 2]
        for output in outputs:
            assert output.outputs[0].token_ids == expected[output.prompt]
    assert free_blocks_are_all(clients[0])  # engine-wide: the other client's requests are done too
    for client in clients:
        client.shutdown()
    with LLM(tiny_path, core_address=daemon) as later:  # the daemon keeps serving after clients leave
        assert (
            later.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids == expected[PROMPTS[0]]
        )
        assert free_blocks_are_all(later)


def test_a_frontend_with_another_tokenizer_is_refused(daemon, tiny_path, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for item in Path(tiny_path).iterdir():
        if item.name != "tokenizer.json":
            os.symlink(item, other / item.name)
    tokenizer = json.loads((Path(tiny_path) / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][0], "id": 50257, "content": "<|extra|>"})
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="tokenizer does not match"):
        LLM(str(other), core_address=daemon)


def test_the_daemon_refuses_a_non_loopback_address_without_the_flag(tiny_path):
    result = subprocess.run(
        [sys.executable, "-m", "engine_core", "--model", tiny_path, "--address", "tcp://0.0.0.0:5999"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "not loopback" in result.stderr
