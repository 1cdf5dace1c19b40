"""coreserve/frontend/engine/weights_buffer.py: update_weights' shared-memory file, kept between updates and rewritten in
place, freed by keep_buffer=False, shutdown and exit, and a dead process's file cleaned up."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

from coreserve import LLM, SamplingParams
from coreserve.frontend.engine.weights_buffer import WeightsBuffer


def test_the_file_is_rewritten_in_place_with_each_updates_tensors():
    buffer = WeightsBuffer()
    first = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 4, dtype=torch.bfloat16)}
    path = buffer.write(first.items())
    inode = os.stat(path).st_ino
    second = {"a": torch.full((10,), 7.0)}  # shorter: the tail of the first must be cut off
    assert buffer.write(second.items()) == path and os.stat(path).st_ino == inode
    loaded = load_file(path)
    assert list(loaded) == ["a"] and torch.equal(loaded["a"], second["a"])
    assert os.path.getsize(path) < 1000 * 4
    folder = buffer.folder
    buffer.release()
    deadline = time.monotonic() + 10
    while os.path.exists(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(folder) and buffer.folder is None


def test_a_dead_processs_folder_is_removed_when_a_buffer_is_made():
    code = "from coreserve.frontend.engine.weights_buffer import WeightsBuffer; import os, torch; " \
           "b = WeightsBuffer(); print(b.write([('x', torch.ones(4))])); os._exit(0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    left = os.path.dirname(out.stdout.strip())
    assert os.path.isdir(left)  # os._exit: no finalizer ran, as after a kill
    buffer = WeightsBuffer()
    buffer.write([("y", torch.zeros(2))])
    assert not os.path.exists(left)
    buffer.release()


def test_updates_reuse_one_file_and_shutdown_frees_it(tiny_path):
    with LLM(tiny_path, max_model_len=64) as llm:
        state = [(name, param.detach().clone()) for name, param in _hf_state(tiny_path)]
        params = SamplingParams(max_tokens=4, temperature=0, logprobs=1)
        before = llm.generate(["a b c"], params, use_tqdm=False)[0].outputs[0]
        assert llm.update_weights([(n, t * 0.5) for n, t in state]) == 1
        halved = llm.generate(["a b c"], params, use_tqdm=False)[0].outputs[0]
        assert halved.logprobs[0][halved.token_ids[0]].logprob != before.logprobs[0][before.token_ids[0]].logprob
        path = llm.engine.weights_buffer.folder
        inode = os.stat(os.path.join(path, "model.safetensors")).st_ino
        assert llm.update_weights(state) == 2  # the original weights again, through the same file
        assert os.stat(os.path.join(path, "model.safetensors")).st_ino == inode
        again = llm.generate(["a b c"], params, use_tqdm=False)[0].outputs[0]
        assert again.token_ids == before.token_ids
        assert [lp[t].logprob for lp, t in zip(again.logprobs, again.token_ids)] == [
            lp[t].logprob for lp, t in zip(before.logprobs, before.token_ids)
        ]
        assert llm.update_weights(state, keep_buffer=False) == 3
        assert llm.engine.weights_buffer.folder is None
        llm.update_weights(state)
        path = llm.engine.weights_buffer.folder
        assert os.path.isdir(path)
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(path)


def _hf_state(model_dir: str):
    from safetensors.torch import load_file as load

    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            yield from load(os.path.join(model_dir, name)).items()
