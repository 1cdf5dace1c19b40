"""TensorParallelExecutor: the engine core's Executor when `tensor_parallel_size` > 1. It starts one
process per rank (coreserve/worker/parallel/rank.py), sends each step's SchedulerOutput to all of them and
returns rank 0's output (engine-core process).

A rank that fails or exits makes `execute` raise, so the core stops with the reason instead of
waiting: no step hangs on a dead rank. Rank 0's progress reports reach the core's `on_progress`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
import zmq

from coreserve.protocol.step import ModelRunnerOutput, SchedulerOutput
from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.loader import read_config
from coreserve.worker.models.sharding import shard_args
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
    ToCore,
    WorkerSpec,
    from_wire,
)
from coreserve.worker.runner_control import RUNNER_VERBS
from coreserve.worker.step.runner_spec import RunnerSpec

logger = logging.getLogger(__name__)

_POLL_MS = 100
_SHUTDOWN_WAIT_S = 10.0


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker failed or exited; the engine cannot go on."""


class TensorParallelExecutor:
    def __init__(self, spec: RunnerSpec, on_progress: Callable[[], None] | None = None) -> None:
        size = spec.tensor_parallel_size
        self.model_args: DecoderArgs = DecoderArgs.from_hf_config(read_config(spec.model))  # the whole model's
        shard_args(self.model_args, size)  # a ValueError now, before any process starts
        self.pooling = None  # the pooling runner is not built under tensor parallelism (each rank refuses it)
        self.size = size
        self.is_cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
        self.on_progress = on_progress
        num_threads = spec.num_threads or max(1, torch.get_num_threads() // size)  # the core's, shared out
        self.folder = tempfile.mkdtemp(prefix="coreserve-tp-")
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToCore)
        try:
            for rank in range(size):
                worker = WorkerSpec(
                    address=self._bind(rank),
                    rank=rank,
                    size=size,
                    store_path=str(Path(self.folder) / "store"),
                    runner=spec,
                    num_threads=num_threads,
                )
                self.procs.append(_spawn(worker))
            ready = self._gather(Ready)
            self._bytes_per_block = ready[0].bytes_per_block
        except BaseException:
            self.close()
            raise

    def bytes_per_block(self) -> int:
        """One rank's (each holds its share of the KV heads, so all are equal)."""
        return self._bytes_per_block

    def host_kv_bytes(self, num_blocks: int) -> int:
        """Every rank's share, in this host's memory where the ranks run on the CPU."""
        return self.size * num_blocks * self._bytes_per_block if not self.is_cuda else 0

    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0, num_snapshot_slots: int = 0) -> None:
        assert not num_state_slots, "a hybrid model under tensor parallelism is refused at load"
        self._send_all(AllocateKvCache(num_blocks))
        self._gather(Done)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._send_all(Execute(scheduler_output))
        first = self._gather(Done)[0].output
        assert first is not None
        return from_wire(first)

    def collective_rpc(self, verb: str, kwargs: dict) -> list:
        """The runner's `verb` on every rank (one RankCall); each rank's result, in rank order. Refused
        by every rank: a ValueError, every rank as it was. Refused by some while the others did it (an
        update whose checks every rank passed, then the file changed): the ranks now differ, so the
        engine stops (WorkerFailed) and no mix of weights ever serves."""
        assert verb in RUNNER_VERBS, verb  # the ranks take no other name either
        self._send_all(RankCall(verb, kwargs))
        replies = self._gather((Done, Refused))
        refused = [r.reason for r in replies if isinstance(r, Refused)]
        if refused and len(refused) < self.size and RUNNER_VERBS[verb].changes_state:
            raise WorkerFailed(
                f"{verb}: {len(refused)} of {self.size} ranks refused it and the others did it: {refused[0]}"
            )
        if refused:
            raise ValueError(refused[0])
        return [r.result for r in replies]

    def close(self) -> None:
        """Stops the workers (politely, then by force) and removes their folder; safe to call twice."""
        for sock in self.sockets:
            try:
                sock.send(self.encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=_SHUTDOWN_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.sockets:
            sock.close(linger=0)
        self.sockets, self.procs = [], []
        self.ctx.term()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _bind(self, rank: int) -> str:
        sock = self.ctx.socket(zmq.PAIR)
        address = f"ipc://{self.folder}/rank{rank}"
        sock.bind(address)
        self.sockets.append(sock)
        return address

    def _send_all(self, message: msgspec.Struct) -> None:
        frame = self.encoder.encode(message)  # encoded once for every rank
        for sock in self.sockets:
            sock.send(frame, copy=False)

    def _gather(self, kind: type | tuple[type, ...]) -> list:
        """One reply of `kind` from every rank, in rank order. Progress messages count as the step's
        progress; a Failed reply or a worker that exits raises WorkerFailed."""
        replies: list = [None] * self.size
        poller = zmq.Poller()
        for sock in self.sockets:
            poller.register(sock, zmq.POLLIN)
        while any(r is None for r in replies):
            events = dict(poller.poll(_POLL_MS))
            for rank, sock in enumerate(self.sockets):
                if sock in events:
                    self._take(rank, sock, kind, replies)
            if not events:
                self._check_alive()
        return replies

    def _take(self, rank: int, sock: zmq.Socket, kind: type, replies: list) -> None:
        message = self.decoder.decode(sock.recv(copy=False).buffer)
        if isinstance(message, Progress):
            if self.on_progress is not None:
                self.on_progress()
        elif isinstance(message, Failed):
            raise WorkerFailed(f"tensor-parallel worker failed: {message.reason}")
        elif isinstance(message, kind) and replies[rank] is None:
            replies[rank] = message
        else:
            raise WorkerFailed(f"tensor-parallel rank {rank} sent {type(message).__name__}, not {kind}")

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                raise WorkerFailed(f"tensor-parallel rank {rank} exited with code {code}")


def _spawn(spec: WorkerSpec) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "coreserve.worker.parallel.rank", msgspec.json.encode(spec).decode()]
    # A session of its own: a signal to the core's group (Ctrl+C on a daemon) reaches the core alone, which
    # stops its ranks (close); a rank whose core dies stops by itself.
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
