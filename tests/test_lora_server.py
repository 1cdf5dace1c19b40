"""LoRA through the HTTP server (coreserve/frontend/server/lora.py), driven by the official openai client:
`--enable-lora --lora-modules`, `"model": <adapter>` giving the in-process engine's numbers with that
adapter, /v1/models listing adapters with their parent, /v1/load_lora_adapter (load_inplace included) and
/v1/unload_lora_adapter, vllm:lora_requests_info in /metrics, and the refusals."""

from __future__ import annotations

import asyncio
import json
import shutil
from contextlib import suppress

import httpx
import openai
import pytest
from conftest import IS_BF16_MODE
from server_harness import running_server
from test_lora import ALL_TARGETS, write_adapter

from coreserve import LLM, LoRARequest, SamplingParams

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
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=3)
    assert completion.model == model  # the adapter's name, as vLLM answers
    choice = completion.choices[0]
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
        assert bad.status_code == 404 and "not found" in bad.text
        scored = httpx.post(f"{url}/v1/score", json={"model": "first", "query": PROMPT[:3], "items": [PROMPT[3:]],
                                                     "label_token_ids": [318, 257]})
        assert scored.status_code == 200 and scored.json()["model"] == "first", scored.text
        tokens = httpx.post(f"{url}/inference/v1/generate", json={
            "model": "first", "token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 0.0}})
        assert tokens.status_code == 200 and tokens.json()["model"] == "first", tokens.text
        smuggled = httpx.post(f"{url}/inference/v1/generate", json={  # a body cannot name a path itself
            "model": "builtin:tiny", "token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "lora": ["x", 7, first]}})
        assert smuggled.status_code == 400 and "lora" in smuggled.text
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


# ---- vLLM's tests/entrypoints/openai/test_lora_adapters.py, on the tiny model and a PEFT adapter ----


@pytest.fixture(scope="module")
def vllm_server(folders):
    module = json.dumps({"name": "zephyr-lora", "path": folders[0], "base_model_name": "builtin:tiny"})
    flags = ["--enable-lora", "--lora-modules", module, "--max-lora-rank", "64", "--max-cpu-loras", "2",
             "--max-num-seqs", "64"]
    with running_server(*flags) as (url, _):
        yield url


def run_async(url: str, body):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none") as client:
            return await body(client)
    return asyncio.run(main())


def test_vllm_static_and_dynamic_lora_lineage(vllm_server, folders):
    async def body(client):
        models = (await client.models.list()).data
        assert models[0].id == "builtin:tiny" and models[0].parent is None
        assert [(m.id, m.root, m.parent) for m in models[1:]] == [("zephyr-lora", folders[0], "builtin:tiny")]
        response = await client.post("load_lora_adapter", cast_to=str,
                                     body={"lora_name": "zephyr-lora-3", "lora_path": folders[0]})
        assert "success" in response.lower()
        dynamic = (await client.models.list()).data[-1]
        assert (dynamic.id, dynamic.root, dynamic.parent) == ("zephyr-lora-3", folders[0], "builtin:tiny")
    run_async(vllm_server, body)


@pytest.mark.parametrize("config_change, expected_error", [
    ({"r": 1024}, "is greater than max_lora_rank"),
    ({"bias": "all"}, "Adapter bias cannot be used without bias_enabled"),
    ({"use_dora": True}, "does not yet support DoRA"),
    ({"r": 0}, "r must be a positive integer, got 0"),  # coreserve's own: an adapter is untrusted input
    ({"lora_alpha": float("inf")}, "lora_alpha must be a finite number >= 0, got inf"),
])  # vLLM's fourth case, modules_to_save ["lm_head"], is served here (issue 52 asks for it)
def test_vllm_dynamic_lora_bad_requests(vllm_server, folders, tmp_path, config_change, expected_error):
    folder = tmp_path / "changed"
    shutil.copytree(folders[0], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **config_change}))

    async def body(client):
        with pytest.raises(openai.BadRequestError, match=expected_error):
            await client.post("load_lora_adapter", cast_to=str, body={"lora_name": "bad", "lora_path": str(folder)})
        with pytest.raises(openai.NotFoundError):
            await client.post("load_lora_adapter", cast_to=str,
                              body={"lora_name": "notfound", "lora_path": "/not/an/adapter"})
    run_async(vllm_server, body)


def test_a_nan_in_an_adapter_is_a_400_naming_the_tensor_and_the_server_goes_on(vllm_server, folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan"
    shutil.copytree(folders[0], folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, folder / "adapter_model.safetensors")
    load = httpx.post(f"{vllm_server}/v1/load_lora_adapter", json={"lora_name": "nan", "lora_path": str(folder)})
    assert load.status_code == 400 and f"{key!r} holds non-finite values" in load.text, load.text
    assert "success" not in load.text.lower()
    assert "nan" not in {m["id"] for m in httpx.get(f"{vllm_server}/v1/models").json()["data"]}
    served = httpx.post(f"{vllm_server}/v1/completions", json={"model": "zephyr-lora", "prompt": PROMPT, "max_tokens": 2})
    assert served.status_code == 200, served.text


def test_vllm_many_adapters_at_once_and_bad_loads_break_nothing(vllm_server, folders, tmp_path):
    """Ten adapters loaded and run at once past --max-cpu-loras 2 (the idle ones dropped and read again),
    and bad loads between good requests."""
    invalid = tmp_path / "invalid_files"
    invalid.mkdir()
    (invalid / "adapter_config.json").write_text("this is not json")

    async def load_and_run(client, name: str):
        await client.post("load_lora_adapter", cast_to=str, body={"lora_name": name, "lora_path": folders[1]})
        return [await client.completions.create(model=name, prompt=["Hello there", "Foo bar bazz buzz"], max_tokens=5,
                                                temperature=0.0) for _ in range(3)]

    async def body(client):
        results = await asyncio.gather(*(load_and_run(client, f"adapter_{i}") for i in range(10)))
        texts = {tuple(c.text for c in r.choices) for runs in results for r in runs}
        assert len(texts) == 1  # the same adapter under ten names: the same greedy text
        stop = asyncio.Event()

        async def good():
            answers = []
            while not stop.is_set():
                answers.append(await client.completions.create(model="zephyr-lora", prompt=["Hello there"], max_tokens=5,
                                                               temperature=0.0))
            return answers

        task = asyncio.create_task(good())
        for _ in range(5):
            with suppress(openai.NotFoundError):
                await client.post("load_lora_adapter", cast_to=str, body={"lora_name": "nf", "lora_path": "/not/here"})
            with suppress(openai.BadRequestError):
                await client.post("load_lora_adapter", cast_to=str, body={"lora_name": "inv", "lora_path": str(invalid)})
        stop.set()
        assert len({a.choices[0].text for a in await task}) == 1
    run_async(vllm_server, body)
