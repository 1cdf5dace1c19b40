"""LoRA adapters through the server, vLLM's names (frontend process, HTTP server; docs/lora.md):
`--enable-lora`, `--lora-modules name=path` (or vLLM's JSON form), `"model": "<adapter name>"` on every
generation route, the adapters in `/v1/models` with their parent, and `POST /v1/load_lora_adapter`
(`lora_name`, `lora_path`, `load_inplace`) and `POST /v1/unload_lora_adapter` (`lora_name`). vLLM serves
the two routes only under VLLM_ALLOW_RUNTIME_LORA_UPDATING; here `--enable-lora` serves them (behind the
API key where one is set), since RL syncs are what they are for. A path that is a Hugging Face hub id
(ORG/NAME, no local path) is fetched by the engine first (coreserve/frontend/lora.py; `root` in /v1/models
stays the id). The core checks every load (the path
against `--lora-allowed-roots` where set, the adapter's files as untrusted input); its refusal is a 400
(a missing path a 404) and nothing is recorded.
"""

from __future__ import annotations

import json

from fastapi import Request, Response
from pydantic import BaseModel, ConfigDict

from coreserve.frontend.server.common.errors import APIError
from coreserve.protocol.sampling_params import LoraRef


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name is what is read


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """`--lora-modules` values: `name=path` or vLLM's JSON `{"name": ..., "path": ...}`."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            entry = json.loads(value)
            if not isinstance(entry, dict) or set(entry) - {"name", "path", "base_model_name"} or "name" not in entry \
                    or "path" not in entry:
                raise ValueError(f"--lora-modules {value!r}: JSON with name and path (and base_model_name) only")
            modules.append((str(entry["name"]), str(entry["path"])))
        elif "=" in value:
            name, path = value.split("=", 1)
            modules.append((name, path))
        else:
            raise ValueError(f"--lora-modules {value!r}: give name=path or JSON {{\"name\": ..., \"path\": ...}}")
    return modules


async def load_modules(server, modules: list[tuple[str, str]]) -> None:
    """The adapters of --lora-modules, loaded before the server listens (a bad one stops the start)."""
    for name, path in modules:
        int_id = await server.engine.load_lora_adapter(name, path)
        server.loras[name] = LoraRef(name, int_id, path)


async def load_lora_adapter(request: Request, body: LoadLoraRequest) -> Response:
    server = request.app.state.server
    if body.lora_name == server.served_model_name:
        raise APIError(400, f"{body.lora_name!r} is the base model's name", "lora_name")
    known = server.loras.get(body.lora_name)
    if known is not None and not body.load_inplace:
        raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded. "
                       "Set load_inplace=true to replace it.", "lora_name")
    try:
        int_id = await server.engine.load_lora_adapter(body.lora_name, body.lora_path, body.load_inplace)
    except ValueError as exc:  # a path that is not there is vLLM's 404, anything else wrong its 400
        missing = str(exc).endswith("not found")
        raise APIError(404 if missing else 400, str(exc), "lora_path", "not_found" if missing else None) from exc
    server.loras[body.lora_name] = LoraRef(body.lora_name, int_id, body.lora_path)
    verb = "reloaded" if known is not None else "added"
    return Response(f"Success: LoRA adapter '{body.lora_name}' {verb} successfully.", media_type="text/plain")


async def unload_lora_adapter(request: Request, body: UnloadLoraRequest) -> Response:
    server = request.app.state.server
    if body.lora_name not in server.loras:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name", "model_not_found")
    await server.engine.unload_lora_adapter(body.lora_name)
    del server.loras[body.lora_name]
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


def adapter_models(server) -> list[dict]:
    """/v1/models' entries of the adapters, as vLLM lists them: root their path, parent the base's name."""
    return [
        {"id": ref.name, "object": "model", "created": server.started_at, "owned_by": "coreserve",
         "root": ref.path, "parent": server.served_model_name, "max_model_len": server.facts.max_model_len}
        for ref in sorted(server.loras.values(), key=lambda r: r.name)
    ]
