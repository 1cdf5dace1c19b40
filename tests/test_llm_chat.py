"""LLM.chat: renders with the tokenizer's chat template (or the given one) and generates; the BOS once."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from coreserve import LLM, SamplingParams

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (  # Qwen's shape: no BOS in the template
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Bonjour ! Qu'est-ce que 日本語 ? 🎉"},
]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_llm(family_model, tmp_path_factory):
    """The Llama 3.1 test model with a Llama 3 chat template in its tokenizer files."""
    source, folder = Path(family_model("llama3.1")), tmp_path_factory.mktemp("chat")
    for item in source.iterdir():
        if not item.name.startswith(("tokenizer", "chat_template")):
            (folder / item.name).symlink_to(item)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.chat_template = LLAMA3_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    with LLM(str(folder), multiprocess=False) as llm:
        yield llm


def test_chat_equals_generate_on_the_rendered_prompt_with_one_bos(chat_llm):
    tokenizer = chat_llm.get_tokenizer()
    (chat,) = chat_llm.chat(MESSAGES, GREEDY, use_tqdm=False)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(tokenizer.bos_token) and chat.prompt == rendered
    token_ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert chat.prompt_token_ids == token_ids and token_ids.count(tokenizer.bos_token_id) == 1
    (direct,) = chat_llm.generate({"prompt_token_ids": token_ids}, GREEDY, use_tqdm=False)
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    assert chat.outputs[0].text == direct.outputs[0].text


def test_a_given_template_without_bos_gets_the_tokenizers_bos(chat_llm):
    tokenizer = chat_llm.get_tokenizer()
    first, second = chat_llm.chat(
        [MESSAGES, MESSAGES[1:]], GREEDY, chat_template=CHATML_TEMPLATE, use_tqdm=False
    )
    assert first.prompt.startswith("<|im_start|>system")
    assert first.prompt_token_ids == tokenizer(first.prompt).input_ids
    assert (
        first.prompt_token_ids[0] == tokenizer.bos_token_id
        and first.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    )
    assert second.prompt.startswith("<|im_start|>user")


def test_add_generation_prompt_false_ends_on_the_last_message(chat_llm):
    (chat,) = chat_llm.chat(MESSAGES, GREEDY, add_generation_prompt=False, use_tqdm=False)
    assert chat.prompt.endswith("<|eot_id|>")


def test_a_model_without_a_chat_template_cannot_chat(family_model):
    with LLM(family_model("llama2"), multiprocess=False) as llm:
        with pytest.raises(ValueError, match="chat template"):
            llm.chat(MESSAGES, GREEDY)
