"""Chat templates as untrusted code (coreserve/frontend/engine/template_sandbox.py): a render gives transformers'
own text, and a hostile one ends in a ValueError naming the limit it passed, without growing the caller or
holding a renderer; over HTTP it is a 400 while other routes keep answering, and a client that leaves
stops its render."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import CHATML, latencies_while, running_server

from coreserve.frontend.engine.chat_template import chat_render_args
from coreserve.frontend.engine.engine_args import load_tokenizer
from coreserve.frontend.engine.template_sandbox import RenderCancelled, TemplateSandbox
from coreserve.protocol.builtin_model import builtin_model_path

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Bonjour, 日本語 ? 🎉"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
TOOLS_TEMPLATE = (
    "{% if tools %}{% for t in tools %}[{{ t | tojson }}]{% endfor %}{% endif %}{{ bos_token }}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if think %} (think){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 10^10 steps
HUGE = "{{ 'x' * 10**9 }}"
# the server's template: hostile only where a message asks, so one server serves every case
ON_DEMAND = (
    "{% if messages[-1]['content'] == 'spin' %}" + SPIN + "{% elif messages[-1]['content'] == 'huge' %}"
    + HUGE + "{% else %}" + CHATML + "{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(builtin_model_path("tiny"))


@pytest.fixture(scope="module")
def sandbox():
    sandbox = TemplateSandbox(1.0, 4096, num_workers=1)
    yield sandbox
    sandbox.close()


@pytest.mark.parametrize("template, tools, variables", [
    (CHATML, None, {}), (TOOLS_TEMPLATE, TOOLS, {"think": True}), (TOOLS_TEMPLATE, None, {}),
])
def test_a_render_is_apply_chat_templates_text(sandbox, tokenizer, template, tools, variables):
    args = chat_render_args(tokenizer, MESSAGES, template, True, tools, variables)
    expected = tokenizer.apply_chat_template(
        MESSAGES, chat_template=template, tools=tools, tokenize=False, add_generation_prompt=True, **variables
    )
    assert sandbox.render(*args) == expected


@pytest.mark.parametrize("template, limit", [
    (SPIN, "time limit of 1 s"), (HUGE, "memory limit of 256 MiB"), ("{{ 'x' * 5000 }}", "limit of 4096 characters"),
    ("{{ raise_exception('no system messages') }}", "no system messages"), ("{% for %}", "failed on these messages"),
])
def test_a_hostile_template_is_a_value_error_naming_its_limit_and_the_next_render_works(
    sandbox, tokenizer, template, limit
):
    started = time.monotonic()
    with pytest.raises(ValueError, match=limit):
        sandbox.render(*chat_render_args(tokenizer, MESSAGES, template, True))
    assert time.monotonic() - started < 3.0
    assert sandbox.render(*chat_render_args(tokenizer, MESSAGES, CHATML, True)).startswith("<|im_start|>system")


def test_a_cancelled_render_stops_at_once(sandbox, tokenizer):
    cancelled = threading.Event()
    threading.Timer(0.2, cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(RenderCancelled):
        sandbox.render(*chat_render_args(tokenizer, MESSAGES, SPIN, True), cancelled=cancelled)
    assert time.monotonic() - started < 0.6


def test_values_json_cannot_carry_are_refused(sandbox, tokenizer):
    with pytest.raises(ValueError, match="JSON values"):
        sandbox.render(*chat_render_args(tokenizer, MESSAGES, CHATML, True, None, {"when": object()}))


def _rss_mib(pid: int) -> float:
    """The process's and its children's resident memory."""
    total = 0.0
    for status in [Path(f"/proc/{pid}/status"), *Path(f"/proc/{pid}/task").glob("*/children")]:
        if status.name == "children":
            total += sum(_rss_mib(int(child)) for child in status.read_text().split())
        else:
            total += int(status.read_text().split("VmRSS:")[1].split()[0]) / 1024
    return total


def test_the_server_refuses_hostile_renders_while_other_routes_answer(tmp_path):
    template = tmp_path / "on_demand.jinja"
    template.write_text(ON_DEMAND)
    flags = ("--chat-template", str(template), "--chat-template-timeout", "20")
    with running_server(*flags) as (base, process), httpx.Client(base_url=base, timeout=30) as http:
        chat = {"model": "builtin:tiny", "max_tokens": 2, "temperature": 0}
        ask = {**chat, "messages": [{"role": "user", "content": "hello"}]}
        assert http.post("/v1/chat/completions", json=ask).status_code == 200
        before = _rss_mib(process.pid)

        def drop(content: str) -> None:  # a client that leaves after a second
            with pytest.raises(httpx.ReadTimeout):
                body = {**chat, "messages": [{"role": "user", "content": content}]}
                httpx.post(base + "/v1/chat/completions", json=body, timeout=1.0)

        droppers = [threading.Thread(target=drop, args=("spin",)) for _ in range(4)]
        for thread in droppers:
            thread.start()
        completion = {"model": "builtin:tiny", "prompt": "a b c", "max_tokens": 2}
        _, _, latencies = latencies_while(base, lambda: [t.join() for t in droppers], "/ready")
        started = time.monotonic()
        assert http.post("/v1/completions", json=completion).status_code == 200
        assert time.monotonic() - started < 1.0 and max(latencies) < 1.0
        started = time.monotonic()  # the dropped renders were stopped: renderers are free long before 20 s
        assert http.post("/v1/chat/completions", json=ask).status_code == 200
        assert time.monotonic() - started < 5.0
        huge = http.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": "huge"}]})
        assert huge.status_code == 400 and "memory limit" in huge.json()["error"]["message"]
        tokenized = http.post("/tokenize", json={"model": "builtin:tiny", "messages": [{"role": "user", "content": "huge"}]})
        assert tokenized.status_code == 400 and "memory limit" in tokenized.json()["error"]["message"]
        assert _rss_mib(process.pid) - before < 512
        assert http.get("/ready").status_code == 200
