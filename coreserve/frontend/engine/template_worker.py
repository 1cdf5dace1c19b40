"""The chat-template renderer's own process: renders one conversation at a time with transformers' own
Jinja renderer, under a cap on its address space (a child of the frontend process; started and killed by
coreserve/frontend/engine/template_sandbox.py, which owns the time limit).

Run as a file, not as a module of the package, so that it imports nothing of coreserve (the package's
imports are the user's process's, not a renderer's): the standard library, msgspec and transformers'
chat-template module, about 60 MB. Frames on stdin and stdout are a 4-byte big-endian length and one
JSON object (no pickle): a request {"template", "messages", "tools", "variables",
"add_generation_prompt", "max_chars"}; a reply {"text"} or {"error", "kind"}, kind one of "template"
(the template refused or failed on these messages), "memory" (the cap; the process exits after it),
"length" (the text is over max_chars). EOF on stdin ends the process.
"""

from __future__ import annotations

import os
import resource
import struct
import sys

_LENGTH = struct.Struct(">I")


def main() -> None:
    memory_cap = int(sys.argv[1])  # bytes of address space this process may grow by after its imports
    import jinja2
    import msgspec
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    _cap_address_space(memory_cap)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.read(_LENGTH.size)
        if len(header) < _LENGTH.size:
            return
        request = msgspec.json.decode(stdin.read(_LENGTH.unpack(header)[0]))
        try:
            reply = _render(render_jinja_template, _normalize_chat_messages, request)
        except MemoryError:
            reply = {"kind": "memory", "error": "the chat template ran past its memory limit"}
        except jinja2.TemplateError as exc:
            reply = {"kind": "template", "error": f"the chat template failed on these messages: {exc}"}
        except Exception as exc:  # noqa: BLE001 - whatever a template raises is its failure on these messages
            reply = {"kind": "template", "error": f"the chat template failed on these messages: {exc!r}"}
        body = msgspec.json.encode(reply)
        stdout.write(_LENGTH.pack(len(body)) + body)
        stdout.flush()
        if reply.get("kind") == "memory":
            return  # what is left of the heap after a MemoryError is not worth trusting


def _render(render_jinja_template, normalize, request: dict) -> dict:
    """What apply_chat_template(tokenize=False) does once it has picked the template and its variables."""
    rendered, _ = render_jinja_template(
        conversations=[normalize(request["messages"])],
        tools=request["tools"],
        documents=None,
        chat_template=request["template"],
        add_generation_prompt=request["add_generation_prompt"],
        **request["variables"],
    )
    text = rendered[0]
    if len(text) > request["max_chars"]:
        return {"kind": "length", "error": f"{len(text)} characters", "num_chars": len(text)}
    return {"text": text}


def _cap_address_space(growth: int) -> None:
    """RLIMIT_AS at what the process maps now plus `growth` (Linux; elsewhere only the time limit holds)."""
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return
    resource.setrlimit(resource.RLIMIT_AS, (mapped + growth, resource.RLIM_INFINITY))


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder holds coreserve's modules, which must not shadow any other
    main()
