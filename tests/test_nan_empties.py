"""No uninitialized memory reaches an output: the heads check refuses a model whose attention would
leave heads unwritten, and the NaN switch (coreserve/worker/nan_empties.py) proves it would have: with the check
disabled, 4 query heads over 3 KV heads turn the logprobs NaN, where without the switch they were
whatever the heap held. (tests/test_batch_invariance.py runs its engines under the switch.)"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import _SMALL, FAMILY_CONFIGS, peaked_init, real_tokenizer_path

from coreserve import LLM, SamplingParams
from coreserve.worker.models import config as config_module

GREEDY = SamplingParams(max_tokens=2, temperature=0, logprobs=1)


@pytest.fixture(scope="module")
def uneven_heads(tmp_path_factory) -> str:
    """A Llama of 4 query heads over 3 KV heads (its tensors shaped to agree)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = dict(FAMILY_CONFIGS["llama2"])
    tokenizer = AutoTokenizer.from_pretrained(real_tokenizer_path(spec.pop("tokenizer")))
    small = {**_SMALL, "num_attention_heads": 4, "num_key_value_heads": 3}
    config = AutoConfig.for_model(**{**spec, **small}, vocab_size=-(-len(tokenizer) // 64) * 64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(peaked_init(name, param))
    folder = tmp_path_factory.mktemp("uneven")
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return str(folder)


def test_heads_that_are_not_a_multiple_of_the_kv_heads_are_refused_at_load(uneven_heads):
    empty = torch.empty
    with pytest.raises(Exception, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        LLM(uneven_heads, multiprocess=False, fill_empty_with_nan=True)
    assert torch.empty is empty  # a start that fails gives the NaN fill back


def test_with_the_check_disabled_the_switch_turns_the_unwritten_head_nan(uneven_heads, monkeypatch):
    monkeypatch.setattr(config_module, "check_config_numbers", lambda *args, **kwargs: None)
    empty = torch.empty
    with LLM(uneven_heads, multiprocess=False, fill_empty_with_nan=True) as llm:
        (output,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.token_ids) == len(completion.logprobs) == 2
    assert all(math.isnan(entry[token].logprob) for token, entry in zip(completion.token_ids, completion.logprobs))
    assert torch.empty is empty  # the switch went with its engine
