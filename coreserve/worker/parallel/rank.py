"""A tensor-parallel worker process: one rank's ModelRunner, driven by the engine core over a ZeroMQ
PAIR socket (`python -m coreserve.worker.parallel.rank SPEC_JSON`, started by coreserve/worker/parallel/executor.py).

Every rank runs every step on the same SchedulerOutput; the ranks meet inside the model (one sum per
layer half) and at sampling (rank 0's tokens). Rank 0 sends the step's output back; the others only
say they are done. A worker whose core has gone exits on its own (it looks between messages, each
second; a rank left waiting in a collective by a dead peer gets an error from the group).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import msgspec
import zmq

from coreserve.worker.parallel.messages import (
    AllocateKvCache,
    Done,
    Execute,
    Failed,
    Progress,
    RankCall,
    Ready,
    Refused,
    Shutdown,
    ToWorker,
    WorkerSpec,
    to_wire,
)
from coreserve.worker.runner_control import call_verb

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 1.0  # a long step tells the core it still moves, at most this often
_POLL_MS = 1000


def main(argv: list[str]) -> None:
    spec = msgspec.json.decode(argv[0], type=WorkerSpec)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s tp{spec.rank} %(levelname)s %(name)s: %(message)s"
    )
    parent = os.getppid()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(spec.address)
    try:
        runner = _start(spec, sock)
        _serve(runner, sock, parent)
    except Exception as exc:  # tell the core why, then exit non-zero
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        sock.send(msgspec.msgpack.encode(Failed(f"rank {spec.rank}: {exc!r}")))
        sock.close(linger=2000)
        ctx.term()
        sys.exit(1)
    sock.close(linger=1000)
    ctx.term()


def _start(spec: WorkerSpec, sock: zmq.Socket):
    import torch

    from coreserve.worker.model_runner import ModelRunner
    from coreserve.worker.parallel.group import TensorParallelGroup

    torch.set_num_threads(spec.num_threads)
    group = TensorParallelGroup(spec.rank, spec.size, spec.store_path, spec.runner.device)
    on_progress = _progress_sender(sock) if spec.rank == 0 else None
    own = msgspec.structs.replace(spec.runner, owns_process=True)  # a rank's process is its own
    runner = ModelRunner(own, on_progress=on_progress, group=group)
    sock.send(msgspec.msgpack.encode(Ready(runner.bytes_per_block())))
    return runner


def _serve(runner, sock: zmq.Socket, parent: int) -> None:
    decoder, encoder = msgspec.msgpack.Decoder(ToWorker), msgspec.msgpack.Encoder()
    is_first = runner.group.rank == 0
    while True:
        if not sock.poll(_POLL_MS):
            if os.getppid() != parent:  # the core is gone
                return
            continue
        message = decoder.decode(sock.recv(copy=False).buffer)
        if isinstance(message, Shutdown):
            runner.group.close()
            return
        if isinstance(message, AllocateKvCache):
            runner.allocate_kv_cache(message.num_blocks)
            sock.send(encoder.encode(Done()))
        elif isinstance(message, Execute):
            output = runner.execute(message.scheduler_output)
            sock.send(encoder.encode(Done(to_wire(output) if is_first else None)))
        elif isinstance(message, RankCall):
            sock.send(encoder.encode(_call(runner, message)))


def _call(runner, call: RankCall) -> Done | Refused:
    """The runner's control verb, through RUNNER_VERBS alone (another name is a bug: the rank fails).
    A ValueError (a bad update, an adapter that does not fit) is this call's refusal; the rank keeps what
    it had and serves."""
    try:
        return Done(result=call_verb(runner.control, call.verb, call.kwargs))
    except ValueError as exc:
        return Refused(str(exc))


def _progress_sender(sock: zmq.Socket):
    last = [time.monotonic()]
    frame = msgspec.msgpack.encode(Progress())

    def send() -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            sock.send(frame)

    return send


if __name__ == "__main__":
    main(sys.argv[1:])
