"""coreserve/frontend/server/'s shape (issue 50): a small root over rooms, one SamplingParams builder, one delta
accumulator, one metrics table; checked on the source, without a server."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "coreserve" / "frontend" / "server"
BUILDER = "coreserve/frontend/server/common/sampling.py"
# Outside the server, SamplingParams is built only where no request body is read: the LLM face's
# default for prompts given none (user objects are passed as they are) and the engine's defaults
# from the model's generation config.
# pooling_verbs.py: a pooling request's SamplingParams (nothing sampled), for LLM, AsyncLLM and the pooling routes
OTHER_BUILDERS = {"coreserve/frontend/llm.py", "coreserve/frontend/engine/engine.py", "coreserve/frontend/pooling_verbs.py"}


def python_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def constructions(path: Path, name: str) -> list[int]:
    """Lines of `name(...)` or `module.name(...)` calls in the file."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called == name:
                lines.append(node.lineno)
    return lines


def test_the_server_root_holds_at_most_eight_files_over_its_rooms():
    files = [p.name for p in SERVER.glob("*.py")]
    assert len(files) <= 8, files
    rooms = {p.name for p in SERVER.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == {"common", "parsers", "openai", "rl", "scoring", "deploy", "pooling"}, rooms


def test_samplingparams_is_built_in_one_module_of_the_frontend():
    found = {
        f"{relative(path)}:{line}"
        for path in python_files(ROOT / "coreserve" / "frontend")
        if relative(path) not in {BUILDER, *OTHER_BUILDERS}
        for line in constructions(path, "SamplingParams")
    }
    assert not found, f"SamplingParams built outside {BUILDER}: {sorted(found)}"
    assert constructions(ROOT / BUILDER, "SamplingParams")


def test_the_check_finds_a_construction(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import coreserve.protocol.sampling_params as sp\nx = sp.SamplingParams(n=2)\ny = SamplingParams()\n")
    assert constructions(probe, "SamplingParams") == [2, 3]


def test_one_delta_accumulator_merges_every_whole_answer():
    """No route merges deltas its own way: common/accumulate.py's merge is the only function named *merge*."""
    merges = {
        f"{relative(path)}:{node.name}"
        for path in python_files(SERVER)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "merge" in node.name
    }
    assert merges == {"coreserve/frontend/server/common/accumulate.py:merge_piece"}, merges


LOGPROB_WRITER = "coreserve/frontend/server/common/logprob_json.py"
REQUEST_BUILDERS = {"coreserve/frontend/server/openai/responses_input.py"}  # writes a chat body's top_logprobs
# The keys of every logprob shape the server writes (OpenAI's, vLLM's, SGLang's, TRL's)
LOGPROB_KEYS = frozenset((
    "logprob", "top_logprobs", "token_logprobs", "text_offset", "bytes", "decoded_token",
    "output_token_logprobs", "output_top_logprobs", "actual_logprobs", "logprob_token_ids",
))


def written_keys(path: Path) -> list[str]:
    """The string keys a file writes: in dict literals and in subscript assignments."""
    keys = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict):
            keys += [key.value for key in node.keys if isinstance(key, ast.Constant)]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            if isinstance(node.slice, ast.Constant):
                keys.append(node.slice.value)
    return [key for key in keys if isinstance(key, str)]


def test_logprob_json_is_written_in_one_module():
    """Every logprob shape, OpenAI's chat and legacy, vLLM's prompt_logprobs and tokens-out content,
    SGLang's and TRL's, comes from common/logprob_json.py; the routes hand it their positions."""
    found = {
        f"{relative(path)}:{key}"
        for path in python_files(SERVER)
        if relative(path) not in {LOGPROB_WRITER, *REQUEST_BUILDERS}
        for key in written_keys(path)
        if key in LOGPROB_KEYS
    }
    assert not found, f"logprob JSON written outside {LOGPROB_WRITER}: {sorted(found)}"
    assert LOGPROB_KEYS <= set(written_keys(ROOT / LOGPROB_WRITER))


def test_chat_is_rendered_in_one_place():
    """Only coreserve/frontend/engine/chat_template.py's ChatRenderer calls the template sandbox or builds
    its arguments; the server's chat routes and LLM.chat call the renderer."""
    renderer = "coreserve/frontend/engine/chat_template.py"
    offenders = []
    for path in python_files(ROOT / "coreserve" / "frontend"):
        if relative(path) == renderer:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            owner = getattr(func, "value", None)
            on_templates = getattr(owner, "attr", getattr(owner, "id", None)) == "templates"
            if called in ("chat_render_args", "apply_chat_template") or (on_templates and "render" in called):
                offenders.append(f"{relative(path)}:{node.lineno}")
    assert not offenders, offenders
    for caller in ("coreserve/frontend/llm.py", "coreserve/frontend/server/openai/chat_prompt.py"):
        assert "renderer.render" in (ROOT / caller).read_text(), caller


def test_metrics_are_declared_in_one_table():
    """Only common/metrics.py names a Prometheus metric or a prefix of one."""
    offenders = []
    for path in python_files(ROOT / "coreserve" / "frontend"):
        if relative(path) == "coreserve/frontend/server/common/metrics.py":
            continue
        text = path.read_text()
        if "prometheus_client" in text or re.search(r"\"(vllm|coreserve):[a-z_]+\"", text):
            offenders.append(relative(path))
    assert not offenders, offenders


def test_every_row_of_the_table_is_written_under_both_prefixes_with_its_value():
    """The one collector, on hand-made stats and one request's figures: each row under coreserve: and
    under vllm: (vLLM's labels), each reading the same value."""
    from coreserve.frontend.server.common.metrics import METRICS, ServerMetrics
    from coreserve.protocol.messages import EngineStats

    metrics = ServerMetrics()
    metrics.stats = EngineStats(0, num_running=3, num_waiting=1, num_free_kv_blocks=6, num_kv_blocks=8,
                                num_preemptions=2, num_cached_blocks=5, prefix_cache_queries=40,
                                prefix_cache_hits=16)
    timer = metrics.timer(num_prompt_tokens=7, num_completions=1)
    timer.on_tokens(4)
    timer.on_finish(["length"])
    text = metrics.render_local().decode()
    for row in METRICS:
        for prefix in ("coreserve", "vllm"):
            assert f"{prefix}:{row.name}" in text, (prefix, row.name)
    values = {"num_requests_running": 3.0, "kv_cache_usage_perc": 0.25, "prompt_tokens_total": 7.0,
              "generation_tokens_total": 4.0, "num_preemptions_total": 2.0, "prefix_cache_hits_total": 16.0}
    for name, value in values.items():
        plain = re.search(rf"^coreserve:{name} (\S+)$", text, re.M)
        labelled = re.search(rf"^vllm:{name}\{{engine=\"0\",model_name=\"\"\}} (\S+)$", text, re.M)
        assert plain and labelled, (name, text)
        assert float(plain.group(1)) == float(labelled.group(1)) == value, name
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name=""} 1.0' in text


def test_every_server_file_is_short_and_says_what_it_owns():
    for path in python_files(SERVER):
        text = path.read_text()
        assert ast.get_docstring(ast.parse(text)), relative(path)
        if path.name != "__init__.py":
            num_lines = len(text.splitlines())
            assert 40 <= num_lines <= 350, (relative(path), num_lines)


def server_imports(path: Path) -> set[str]:
    """The coreserve.frontend.server modules a file imports, at module level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("coreserve.frontend.server."):
            names.add(node.module)
    return names


def test_rooms_stand_on_common_and_the_root_alone():
    """A dialect's room may use common/, parsers/ (a model's text to message parts) and the root (the app
    and its state); common/ and parsers/ use no room, and no room another: a change to one dialect stays
    in its room."""
    rooms = {"openai", "rl", "scoring", "deploy"}
    for path in python_files(SERVER):
        parts = path.relative_to(SERVER).parts
        own = parts[0] if len(parts) > 1 else None
        for name in server_imports(path):
            room = name.split(".")[2]
            if own is None or room not in rooms:
                continue
            assert room == own, f"{relative(path)} imports {name}"
