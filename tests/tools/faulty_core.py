"""A real engine core with one fault injected, for the tests of what a failing core tells its clients:
`python tests/tools/faulty_core.py MODEL ADDRESS step|output-thread`.

step: the model step raises on the first request (a device failure); output-thread: the output
thread dies (a bug in a thread). Everything else is the daemon as shipped."""

from __future__ import annotations

import logging
import sys

from coreserve.engine_core.core import EngineCore
from coreserve.engine_core.server import CoreServer
from coreserve.protocol.config import EngineConfig


def main(model: str, address: str, fault: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    core = EngineCore(EngineConfig(model=model, num_kv_blocks=64))
    server = CoreServer(core, address)
    if fault == "step":

        def failing_step():
            raise RuntimeError("injected device failure: CUDA error: an illegal memory access")

        core.step = failing_step
    elif fault == "output-thread":

        def failing_discard():
            raise RuntimeError("injected bug in the output thread")

        server._discard_inbound = failing_discard
    server.serve_forever()


if __name__ == "__main__":
    main(*sys.argv[1:])
