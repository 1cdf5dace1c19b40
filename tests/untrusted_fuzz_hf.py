"""Hugging Face folder mutations for the untrusted-input fuzzer (tests/untrusted_fuzz.py), made from the
built-in tiny model's folder: config.json (every number of it extreme, negative, NaN or mistyped; the
whole file not an object, not JSON, nested deep), model.safetensors' header (its length, its encoding,
each entry's fields) and values, model.safetensors.index.json's shard names, the tokenizer files and
generation_config.json. Unchanged files are links to the base's. `catalog()` is the named list; `drawn`
a random one from a seeded generator.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path

from untrusted_mutation import (
    ODD_JSON_VALUES,
    Bases,
    Mutation,
    float_bytes,
    json_bytes,
    linked_copy,
    rewrite_safetensors,
    safetensors_parts,
)

NUMERIC_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                "rope_parameters.rope_theta", "bos_token_id", "eos_token_id")
WEIGHTS = "model.safetensors"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # [64, 256] F32


def _folder(bases: Bases, folder: Path, replaced: dict[str, bytes | None]) -> str:
    return str(linked_copy(bases.hf, folder / "model", replaced))


def _with_key(config: dict, key: str, value: object) -> dict:
    """`config` with the (dotted) key set; `value` None drops it."""
    config = json.loads(json.dumps(config))
    *parents, last = key.split(".")
    inner = config
    for parent in parents:
        inner = inner.setdefault(parent, {})
    if value is None:
        inner.pop(last, None)
    else:
        inner[last] = value
    return config


def config_mutation(description: str, edit: Callable[[dict], object] | bytes | None) -> Mutation:
    """config.json replaced: the base config edited (`edit` returns the new JSON value), raw bytes, or None
    (no config.json)."""

    def make(bases: Bases, folder: Path) -> str:
        if edit is None or isinstance(edit, bytes):
            return _folder(bases, folder, {"config.json": edit})
        config = json.loads((Path(bases.hf) / "config.json").read_text())
        return _folder(bases, folder, {"config.json": json_bytes(edit(config))})

    return Mutation("hf-config", f"config.json: {description}", "model", make)


def set_keys(**values: object) -> Mutation:
    """config.json's keys (`__` for a dot) set to values; None drops one."""
    keys = {key.replace("__", "."): value for key, value in values.items()}

    def edit(config: dict) -> dict:
        for key, value in keys.items():
            config = _with_key(config, key, value)
        return config

    return config_mutation(", ".join(f"{k} = {'(dropped)' if v is None else repr(v)}" for k, v in keys.items()), edit)


def header_mutation(description: str, edit: Callable[[dict], dict | bytes],
                    header_len: Callable[[int], int] | None = None,
                    patches: Callable[[dict], dict[int, bytes]] | None = None) -> Mutation:
    """model.safetensors rewritten: its header edited (a dict, or raw bytes), the length field lying, or
    bytes of the data section overwritten."""

    def make(bases: Bases, folder: Path) -> str:
        source = str(Path(bases.hf) / WEIGHTS)
        header, _ = safetensors_parts(source)
        new = edit(json.loads(json.dumps(header)))
        path = _folder(bases, folder, {WEIGHTS: None})
        raw = new if isinstance(new, bytes) else json.dumps(new).encode()
        rewrite_safetensors(source, Path(path) / WEIGHTS, raw, header_len and header_len(len(raw)),
                            patches and patches(header))
        return path

    return Mutation("safetensors", f"{WEIGHTS}: {description}", "model", make)


def entry_mutation(name: str, field: str, value: object) -> Mutation:
    def edit(header: dict) -> dict:
        header[name] = _with_key(header[name], field, value)
        return header

    return header_mutation(f"{name} {field} = {'(dropped)' if value is None else repr(value)}", edit)


def renamed(name: str, new_name: str | None) -> Mutation:
    def edit(header: dict) -> dict:
        entry = header.pop(name)
        return header if new_name is None else {**header, new_name: entry}

    return header_mutation(f"{name} {'dropped' if new_name is None else f'renamed {new_name}'}", edit)


def nonfinite(name: str, index: int, value: float) -> Mutation:
    def patches(header: dict) -> dict[int, bytes]:
        entry = header[name]
        return {entry["data_offsets"][0] + 4 * index: float_bytes(value, entry["dtype"])}

    return header_mutation(f"{name}[{index}] = {value}", lambda header: header, patches=patches)


def index_mutation(description: str, index: Callable[[list[str], Path], object] | bytes) -> Mutation:
    """model.safetensors.index.json added beside the weights (and x.safetensors, a link to them, one folder
    up: what an escaping name would reach); `index` is given the tensor names and that outside file."""

    def make(bases: Bases, folder: Path) -> str:
        names = [n for n in safetensors_parts(str(Path(bases.hf) / WEIGHTS))[0] if n != "__metadata__"]
        outside = folder / "x.safetensors"
        outside.symlink_to(Path(bases.hf, WEIGHTS).resolve())
        data = index if isinstance(index, bytes) else json_bytes(index(names, outside.resolve()))
        return _folder(bases, folder, {"model.safetensors.index.json": data})

    return Mutation("index", f"model.safetensors.index.json: {description}", "model", make)


def file_mutation(name: str, description: str, data: Callable[[bytes], bytes | None] | bytes | None) -> Mutation:
    """One more file of the folder replaced (tokenizer files, generation_config.json)."""

    def make(bases: Bases, folder: Path) -> str:
        source = Path(bases.hf) / name
        new = data(source.read_bytes() if source.exists() else b"") if callable(data) else data
        return _folder(bases, folder, {name: new})

    return Mutation("hf-files", f"{name}: {description}", "model", make)


def _config() -> list[Mutation]:
    mutations = [set_keys(**{key.replace(".", "__"): value}) for key in NUMERIC_KEYS
                 for value in (0, -1, 2**64 + 1, math.nan, "NaN")]
    mutations += [set_keys(hidden_size=v) for v in ("256", 256.5, True, [256])]
    mutations += [set_keys(num_hidden_layers=v) for v in (5, 2, 4.0)]
    mutations += [set_keys(num_attention_heads=8, num_key_value_heads=3), set_keys(model_type="nope"),
                  set_keys(model_type=None), set_keys(architectures=["NopeForCausalLM"]), set_keys(torch_dtype="int8"),
                  set_keys(torch_dtype=5, dtype=5), set_keys(rope_parameters=[]),
                  set_keys(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0}),
                  set_keys(rope_parameters={"rope_type": "nope", "rope_theta": 10000.0}),
                  set_keys(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": math.nan}),
                  set_keys(tie_word_embeddings="yes"), set_keys(hidden_act="nope"), set_keys(sliding_window=-1),
                  set_keys(sliding_window=2**40), set_keys(attention_bias=True)]
    mutations += [config_mutation("a list", lambda config: [config]), config_mutation("null", lambda config: None),
                  config_mutation("{}", lambda config: {}), config_mutation("not JSON", b"{"),
                  config_mutation("not UTF-8", b'{"model_type": "\xff"}'),
                  config_mutation("nested 100000 deep", b"[" * 100_000), config_mutation("missing", None)]
    return mutations


def _safetensors() -> list[Mutation]:
    same = lambda header: header  # noqa: E731
    raw = lambda header: json.dumps(header).encode()  # noqa: E731
    mutations = [header_mutation(f"header length {shown}", same, length) for shown, length in (
        ("2^64-1", lambda n: 2**64 - 1), ("0", lambda n: 0), ("2^40", lambda n: 2**40), ("+1", lambda n: n + 1))]
    mutations += [header_mutation("header not UTF-8", lambda h: raw(h).replace(b'"__metadata__"', b'"\xff\xfe"')),
                  header_mutation("header not JSON", lambda h: b"{nope"),
                  header_mutation("header a list", lambda h: b"[]"),
                  header_mutation("header nested 100000 deep", lambda h: b"[" * 100_000),
                  header_mutation("__metadata__ a list", lambda h: {**h, "__metadata__": []}),
                  header_mutation(f"{K_PROJ} a number", lambda h: {**h, K_PROJ: 3})]
    end = 8 * 2**60
    for field, value in (("dtype", None), ("shape", None), ("data_offsets", None), ("data_offsets", [0, end]),
                         ("data_offsets", [105107456, 105041920]), ("shape", [64, 255]), ("shape", [256, 64]),
                         ("shape", [-64, -256]), ("shape", [2**62, 2**62]), ("dtype", "F16"), ("dtype", "I8"),
                         ("dtype", "F64"), ("dtype", "BOOL"), ("dtype", "nope")):
        mutations.append(entry_mutation(K_PROJ, field, value))
    mutations.append(entry_mutation(K_PROJ, "data_offsets", [105107456, 105172992]))  # o_proj's first bytes
    mutations += [renamed(K_PROJ, "model.layers.0.self_attn.kk_proj.weight"),
                  renamed(K_PROJ, "model.layers.9.self_attn.k_proj.weight"), renamed(K_PROJ, None)]
    mutations += [nonfinite("model.embed_tokens.weight", 0, math.nan), nonfinite("model.norm.weight", 3, math.inf),
                  nonfinite("model.layers.3.mlp.down_proj.weight", 1000, -math.inf),
                  nonfinite("lm_head.weight", 7, math.nan)]
    return mutations


def _index() -> list[Mutation]:
    def every(shard: str) -> Callable[[list[str]], dict]:
        return lambda names, outside: {"weight_map": dict.fromkeys(names, shard)}

    return [index_mutation("every tensor in ../x.safetensors", every("../x.safetensors")),
            index_mutation("every tensor in /etc/passwd", every("/etc/passwd")),
            index_mutation("every tensor in the absolute path of ../x.safetensors",
                           lambda names, outside: {"weight_map": dict.fromkeys(names, str(outside))}),
            index_mutation("every tensor in missing.safetensors", every("missing.safetensors")),
            index_mutation("weight_map a list", lambda names, outside: {"weight_map": [WEIGHTS]}),
            index_mutation("a list", lambda names, outside: []), index_mutation("not JSON", b"{"),
            index_mutation("weight_map empty", lambda names, outside: {"weight_map": {}}),
            index_mutation("a tensor the shard lacks", lambda names, outside: {
                "weight_map": {**dict.fromkeys(names, WEIGHTS), "model.fake.weight": WEIGHTS}})]


def _files() -> list[Mutation]:
    return [file_mutation("tokenizer.json", "not JSON", b"{"), file_mutation("tokenizer.json", "missing", None),
            file_mutation("tokenizer.json", "cut in half", lambda data: data[: len(data) // 2]),
            file_mutation("tokenizer_config.json", "a list", b"[]"),
            file_mutation("tokenizer_config.json", "tokenizer_class NopeTokenizer",
                          lambda data: json_bytes({**json.loads(data), "tokenizer_class": "NopeTokenizer"})),
            file_mutation("generation_config.json", "temperature 'hot', max_new_tokens -1",
                          json_bytes({"temperature": "hot", "max_new_tokens": -1})),
            file_mutation("generation_config.json", "a list", b"[]"),
            file_mutation("generation_config.json", "not JSON", b"{")]


def catalog() -> list[Mutation]:
    return _config() + _safetensors() + _index() + _files()


def drawn(rng: random.Random, bases: Bases) -> Mutation:
    """A random config key (a number of the base's, or any key) given a random odd value, or a random
    safetensors entry's field given one."""
    value = rng.choice(ODD_JSON_VALUES)
    if rng.random() < 0.6:
        config = json.loads((Path(bases.hf) / "config.json").read_text())
        key = rng.choice([*NUMERIC_KEYS, *config])
        return set_keys(**{key.replace(".", "__"): value})
    header, _ = safetensors_parts(str(Path(bases.hf) / WEIGHTS))
    name = rng.choice(sorted(n for n in header if n != "__metadata__"))
    field, is_item = rng.choice(("dtype", "shape", "data_offsets")), rng.random() < 0.5
    if is_item and field != "dtype":  # one number of the list
        items = header[name][field]
        index = rng.randrange(len(items))
        value = [value if i == index else v for i, v in enumerate(items)]
    return entry_mutation(name, field, value)
