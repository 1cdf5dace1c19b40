"""`coreserve serve`'s command line (coreserve/frontend/server/args.py, coreserve/frontend/cli.py), without starting anything."""

from __future__ import annotations

import pytest

from coreserve.frontend.cli import parser
from coreserve.frontend.server.args import api_key, engine_kwargs, model_to_serve, served_model_name

ENGINE_FLAGS = [
    "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--num-kv-blocks",
    "--kv-cache-gib", "--max-logprobs", "--logprobs-mode", "--num-scheduler-steps", "--dtype", "--seed",
]


def parse(*argv: str):
    return parser().parse_args(["serve", *argv])


def test_only_the_engine_arguments_given_reach_the_engine():
    args = parse(
        "builtin:small", "--max-num-seqs", "8", "--kv-cache-gib", "0.5", "--logprobs-mode", "processed"
    )
    assert engine_kwargs(args) == {"max_num_seqs": 8, "kv_cache_gib": 0.5, "logprobs_mode": "processed"}
    assert engine_kwargs(parse()) == {}


def test_defaults_host_port_and_served_name():
    args = parse()
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)
    assert served_model_name(args) == "builtin:smollm2"  # a real model, not random weights
    assert model_to_serve(args) == "builtin:smollm2"
    assert served_model_name(parse("/models/x")) == "/models/x"
    assert served_model_name(parse("/models/x", "--served-model-name", "x")) == "x"


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.setenv("CORESERVE_API_KEY", "from-env")
    assert api_key(parse()) == "from-env"
    assert api_key(parse("--api-key", "from-flag")) == "from-flag"
    monkeypatch.delenv("CORESERVE_API_KEY")
    assert api_key(parse()) is None


def test_help_documents_every_engine_flag(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    text = capsys.readouterr().out
    for flag in [*ENGINE_FLAGS, "--host", "--port", "--served-model-name", "--api-key", "--chat-template"]:
        assert flag in text
    assert "--core-address" in text
    help_text = " ".join(text.split())  # argparse wraps lines
    for form in ("Hugging Face model folder", ".gguf file", "builtin:smollm2", "builtin:tiny", "builtin:small"):
        assert form in help_text, form


def test_a_bad_engine_flag_value_is_a_usage_error():
    with pytest.raises(SystemExit):
        parse("--logprobs-mode", "cooked")
