"""coreserve's OpenAI-compatible HTTP server over AsyncLLM (frontend process): `coreserve serve`.

`build_app(state)` in `coreserve.frontend.server.app` makes the FastAPI application; `coreserve.frontend.server.launch` starts
an engine and uvicorn from command-line arguments.
"""
