"""Models, GGUF files and LoRA adapters by Hugging Face hub id (coreserve/protocol/hub_ids.py), with no
network: a loopback stand-in for the hub (tests/hub_server.py, HF_ENDPOINT) serves the built-in tiny
model's folder as org/tiny, GGUF files as org/tiny-gguf and a PEFT adapter as org/tiny-lora, and
huggingface_hub itself writes its cache (a fresh HF_HOME) through coreserve's resolver; then, the stand-in
stopped and HF_HUB_OFFLINE set, everything resolves from that cache: `LLM("org/tiny")` gives the local
folder's logprobs bit for bit, a hub adapter the local adapter's, and `coreserve serve org/tiny` answers."""

from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from hub_server import COMMIT, serving_hub
from server_harness import running_server

from coreserve import LLM, LoRARequest, SamplingParams
from coreserve.frontend.lora import adapter_folder
from coreserve.protocol.hub_ids import local_adapter_path, local_model_path, parse_hub_id

QUANT_FILES = ("tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "big-Q2_K-00001-of-00002.gguf", "big-Q2_K-00002-of-00002.gguf")
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=4, prompt_logprobs=4, ignore_eos=True)
PROMPTS = [[(13 * i + 5 * j) % 4000 + 60 for j in range(n)] for i, n in enumerate((6, 21, 11))]


def write_adapter(folder: Path) -> None:
    """A rank-4 PEFT adapter on q_proj and v_proj of the tiny model (256 wide, k/v 64), saved as PEFT names it."""
    from safetensors.numpy import save_file

    rng, tensors = np.random.default_rng(4), {}
    for layer in range(4):
        for module, width in (("q_proj", 256), ("v_proj", 64)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((4, 256)) / 16).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((width, 4)) * 0.3).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))


class Hub:
    """The stand-in's repos and the environment huggingface_hub reads (re-read: its constants module
    reloaded, as at its import in an entry process)."""

    def __init__(self, tiny_path: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tiny, self.adapter, self.monkeypatch = Path(tiny_path), root / "adapter", monkeypatch
        write_adapter(self.adapter)
        (root / "q4.gguf").write_bytes(b"GGUF q4_k_m")
        (root / "other.gguf").write_bytes(b"GGUF other")
        ggufs = {name: root / ("q4.gguf" if "Q4_K_M" in name else "other.gguf") for name in QUANT_FILES}
        index = root / "index.json"  # names one shard; the repo holds the same weights once more beside it
        index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}))
        self.repos = {
            "org/tiny": {p.name: p for p in self.tiny.iterdir() if p.is_file()},
            "org/sharded": {"config.json": self.tiny / "config.json", "model.safetensors.index.json": index,
                            "model-00001-of-00001.safetensors": root / "q4.gguf",
                            "consolidated.safetensors": root / "other.gguf", "pytorch_model.bin": root / "other.gguf",
                            "onnx/model.json": index},
            "org/tiny-gguf": ggufs,
            "org/tiny-lora": {p.name: p for p in self.adapter.iterdir()},
        }
        self.cache = root / "hf" / "hub"
        monkeypatch.setenv("HF_HOME", str(root / "hf"))

    def environment(self, **values: str | None) -> None:
        for name, value in values.items():
            if value is None:
                self.monkeypatch.delenv(name, raising=False)
            else:
                self.monkeypatch.setenv(name, value)
        reload_hub_constants()


def reload_hub_constants() -> None:
    import huggingface_hub.constants

    importlib.reload(huggingface_hub.constants)


@pytest.fixture(scope="module")
def hub(tiny_path, tmp_path_factory):
    """The stand-in serving, huggingface_hub online and pointed at it; afterwards its environment as before."""
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.ExitStack() as serving:
        hub = Hub(tiny_path, tmp_path_factory.mktemp("hub"), monkeypatch)
        hub.environment(HF_ENDPOINT=serving.enter_context(serving_hub(hub.repos)), HF_HUB_OFFLINE=None,
                        TRANSFORMERS_OFFLINE=None)
        hub.stop = serving.close
        hub.fetched = {  # through coreserve's resolver, online: what the offline tests find again
            "org/tiny": local_model_path("org/tiny"),
            "org/tiny-gguf:q4_k_m": local_model_path("org/tiny-gguf:q4_k_m"),
            "org/tiny-lora": local_adapter_path("org/tiny-lora"),
        }
        yield hub
    reload_hub_constants()


@pytest.fixture(scope="module")
def offline(hub):
    """The stand-in stopped (its port closed: nothing answers there) and HF_HUB_OFFLINE set."""
    hub.stop()
    hub.environment(HF_HUB_OFFLINE="1")
    return hub


def test_the_shapes_of_a_hub_id():
    assert parse_hub_id("org/name").repo_id == "org/name"
    assert parse_hub_id("Org/Name-GGUF:q4_k_m").quant == "q4_k_m"
    assert parse_hub_id("org/name/sub/model-Q8_0.gguf").filename == "sub/model-Q8_0.gguf"
    for path in ("./org/name", "/abs/path", "builtin:tiny", "org/model.gguf", "a/b/c", "http://host/x",
                 "org/na..me", "org--x/name", "~/models/x", "org/name:"):
        assert parse_hub_id(path) is None, path


def test_huggingface_hub_fetches_a_folder_a_gguf_of_a_quant_and_an_adapter_into_its_cache(hub):
    folder = Path(hub.fetched["org/tiny"])
    assert folder == hub.cache / "models--org--tiny" / "snapshots" / COMMIT
    assert sorted(p.name for p in folder.iterdir()) == sorted(hub.repos["org/tiny"])
    assert (folder / "model.safetensors").read_bytes() == (hub.tiny / "model.safetensors").read_bytes()
    gguf = Path(hub.fetched["org/tiny-gguf:q4_k_m"])  # the quant matched in any case
    assert gguf.name == "tiny-Q4_K_M.gguf" and gguf.read_bytes() == b"GGUF q4_k_m"
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["tiny-Q4_K_M.gguf"]  # the one file alone
    sharded = Path(local_model_path("org/sharded"))  # the index's shards alone; no pickle, no subfolder
    assert sorted(p.name for p in sharded.iterdir()) == ["config.json", "model-00001-of-00001.safetensors",
                                                         "model.safetensors.index.json"]
    adapter = Path(hub.fetched["org/tiny-lora"])
    assert (adapter / "adapter_model.safetensors").read_bytes() == (hub.adapter / "adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize(("model", "words"), [
    ("org/tiny-gguf:Q2_K", ["big-Q2_K-00001-of-00002.gguf", "split in 2 files", "llama-gguf-split --merge"]),
    ("org/tiny-gguf:Q5_0", ["no GGUF file of quant Q5_0", "tiny-Q8_0.gguf"]),
    ("org/tiny-gguf/none-Q4_0.gguf", ["no file none-Q4_0.gguf"]),
    ("org/nothing", ["'org/nothing' is neither a local path nor a model repository"]),
])
def test_what_the_hub_cannot_give_is_a_value_error_naming_it(hub, model, words):
    with pytest.raises(ValueError) as error:
        local_model_path(model)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_a_revision_is_the_hub_s_and_a_local_path_takes_none(hub, tiny_path):
    with pytest.raises(ValueError, match="no revision 'v9' of org/tiny"):
        local_model_path("org/tiny", revision="v9")
    with pytest.raises(ValueError, match="is for a model given by hub id"):
        local_model_path(tiny_path, revision="main")


def test_offline_every_id_resolves_from_the_cache_and_a_missing_one_is_named(offline):
    for model, path in offline.fetched.items():
        resolve = local_adapter_path if model.endswith("-lora") else local_model_path
        assert resolve(model) == path
    assert local_model_path("org/tiny", revision=COMMIT) == offline.fetched["org/tiny"]
    assert local_model_path("org/tiny-gguf") == offline.fetched["org/tiny-gguf:q4_k_m"]  # llama.cpp's default
    with pytest.raises(ValueError, match="no GGUF file of quant Q8_0 in org/tiny-gguf in the cache"):
        local_model_path("org/tiny-gguf:Q8_0")
    with pytest.raises(ValueError, match=r"'org/missing' is neither a local path nor in the Hugging Face cache "
                                         r".* and HF_HUB_OFFLINE is set"):
        local_model_path("org/missing")


def test_a_local_path_of_a_hub_id_s_shape_wins(offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert local_model_path("org/tiny") == "org/tiny"
    assert adapter_folder("org/tiny", ("/nowhere",)) == "org/tiny"  # the core checks a local path itself


def test_allowed_roots_admit_a_hub_adapter_only_where_its_cache_folder_lies_under_one(offline, tmp_path):
    with pytest.raises(ValueError, match="'org/tiny-lora' is a Hugging Face hub id, and its cache folder"):
        adapter_folder("org/tiny-lora", (str(tmp_path),))
    assert adapter_folder("org/tiny-lora", (str(offline.cache),)) == offline.fetched["org/tiny-lora"]
    one_repo = str(offline.cache / "models--org--tiny-lora")
    assert adapter_folder("org/tiny-lora", (one_repo,)) == offline.fetched["org/tiny-lora"]


def test_the_daemon_resolves_its_own_model_and_names_a_missing_one(offline, capsys):
    from coreserve.engine_core.__main__ import build_config, make_parser

    parser = make_parser()
    args = parser.parse_args(["--model", "org/tiny", "--address", "ipc:///tmp/unused", "--revision", COMMIT])
    config = build_config(parser, args)
    assert (config.model, config.revision) == (offline.fetched["org/tiny"], COMMIT)
    with pytest.raises(SystemExit) as stopped:
        build_config(parser, parser.parse_args(["--model", "org/missing", "--address", "ipc:///tmp/unused"]))
    assert stopped.value.code == 2 and "'org/missing' is neither a local path" in capsys.readouterr().err


def rows(output) -> tuple:
    completion = output.outputs[0]
    return (completion.token_ids, [sorted((t, v.logprob) for t, v in d.items()) for d in completion.logprobs],
            [None if d is None else sorted((t, v.logprob) for t, v in d.items()) for d in output.prompt_logprobs])


def test_a_model_and_an_adapter_by_hub_id_give_the_local_ones_bits(offline, llm_inproc):
    lora_roots = [str(offline.cache), str(offline.adapter.parent)]
    with LLM("org/tiny", multiprocess=False, max_num_batched_tokens=256, num_kv_blocks=512, enable_lora=True,
             lora_allowed_roots=lora_roots) as llm:
        assert llm.config.model == offline.fetched["org/tiny"]
        base = [rows(o) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert base == [rows(o) for o in llm_inproc.generate(PROMPTS, PARAMS, use_tqdm=False)]
        by_id = llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=LoRARequest("hub", 1, "org/tiny-lora"))
        local = llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=LoRARequest("local", 2, str(offline.adapter)))
        assert [rows(o) for o in by_id] == [rows(o) for o in local] != base


def test_coreserve_serve_org_name_answers_offline_from_the_cache(offline):
    flags = ("--enable-lora", "--lora-allowed-roots", str(offline.cache), "--lora-modules", "hub-lora=org/tiny-lora")
    with running_server(*flags, model="org/tiny") as (base, _), httpx.Client(base_url=base, timeout=60) as http:
        models = http.get("/v1/models").json()["data"]
        assert [(m["id"], m.get("root")) for m in models][1:] == [("hub-lora", "org/tiny-lora")]
        assert models[0]["id"] == "org/tiny"
        answers = {}
        for model in ("org/tiny", "hub-lora"):
            reply = http.post("/v1/completions", json={"model": model, "prompt": PROMPTS[1], "max_tokens": 3,
                                                       "temperature": 0, "logprobs": 1})
            assert reply.status_code == 200, reply.text
            answers[model] = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert answers["org/tiny"] != answers["hub-lora"]  # the adapter fetched by id is applied
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "org/missing-lora"})
        assert refused.status_code == 400 and "'org/missing-lora' is neither a local path" in refused.text
