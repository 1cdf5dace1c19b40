"""LoRA through the HTTP server (frontend/server/lora.py), driven by the official openai client:
`--enable-lora --lora-modules`, `"model": <adapter>` giving the in-process engine's numbers with that
adapter, /v1/models listing adapters with their parent, /v1/load_lora_adapter (load_inplace included) and
/v1/unload_lora_adapter, vllm:lora_requests_info in /metrics, and the refusals."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import IS_BF16_MODE
from server_harness import running_server
from test_lora import ALL_TARGETS, write_adapter

from frontend import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.skipif(IS_BF16_MODE, reason="PEFT's adapters are written in fp32")

PROMPT = [464, 3139, 286, 4881, 318, 257, 1957]


@pytest.fixture(scope="module")
def folders(tiny_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    write_adapter(tiny_path, root / "first", 1, 8, 16, ALL_TARGETS)
    write_adapter(tiny_path, root / "second", 2, 4, 8, ["q_proj", "v_proj", "down_proj"], rslora=True)
    return str(root / "first"), str(root / "second")


def in_process(tiny_path, folder: str | None) -> list:
    with LLM(tiny_path, multiprocess=False, enable_lora=True, num_kv_blocks=128) as llm:
        params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3)
        request = None if folder is None else LoRARequest("x", 1, folder)
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False, lora_request=request)[0].outputs[0]
        return [(t, round(d[t].logprob, 5)) for t, d in zip(out.token_ids, out.logprobs)]


def served(client, model: str) -> list:
    choice = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=3).choices[0]
    ids = client.completions.create(  # the ids: vLLM's return_token_ids
        model=model, prompt=PROMPT, max_tokens=5, temperature=0.0, extra_body={"return_token_ids": True}
    ).choices[0].token_ids
    return [(t, round(v, 5)) for t, v in zip(ids, choice.logprobs.token_logprobs)]


def test_adapters_by_name_load_inplace_unload_and_metrics(tiny_path, folders):
    first, second = folders
    expected = {name: in_process(tiny_path, folder) for name, folder in
                (("base", None), ("first", first), ("second", second))}
    assert len({str(v) for v in expected.values()}) == 3
    with running_server("--enable-lora", "--lora-modules", f"first={first}", "--max-loras", "2") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        models = {m.id: m for m in client.models.list().data}
        assert models["first"].model_extra["parent"] == "builtin:tiny" and models["first"].model_extra["root"] == first
        assert served(client, "first") == expected["first"]
        assert served(client, "builtin:tiny") == expected["base"]
        with pytest.raises(openai.NotFoundError):
            served(client, "second")
        load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": second})
        assert load.status_code == 200, load.text
        assert served(client, "second") == expected["second"]
        again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "first", "lora_path": second})
        assert again.status_code == 400 and "load_inplace" in again.text
        inplace = httpx.post(f"{url}/v1/load_lora_adapter",
                             json={"lora_name": "first", "lora_path": second, "load_inplace": True})
        assert inplace.status_code == 200, inplace.text
        assert served(client, "first") == expected["second"]  # the new load's numbers at once
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and "adapter_config.json" in bad.text
        metrics = httpx.get(f"{url}/metrics").text
        assert 'vllm:lora_requests_info{' in metrics and 'max_lora="2"' in metrics
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 200
        assert "second" not in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            served(client, "second")
        assert served(client, "builtin:tiny") == expected["base"]  # the engine goes on


def test_without_enable_lora_the_routes_are_absent(tiny_path):
    with running_server() as (url, _):
        assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}).status_code == 404
