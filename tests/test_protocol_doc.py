"""A client written from docs/protocol.md alone: raw pyzmq and plain msgpack, nothing of coreserve's
frontend, engine_core or protocol. It drives a daemon with sample and prompt logprobs and checks the
result against LLM."""

from __future__ import annotations

import hashlib
import struct
import time
import uuid
from pathlib import Path

import msgspec.msgpack as msgpack  # used as a plain msgpack library: no coreserve types
import pytest
import zmq
from conftest import PROMPTS, running_daemon

FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")


def fingerprint(model_dir: str) -> str:
    digest = hashlib.sha256()
    for name in FILES:
        path = Path(model_dir) / name
        if path.exists():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]


def logprob_rows(array: list) -> list[tuple[list[int], list[float], int]]:
    num_rows, num_cols, token_ids, logprobs, ranks = array[:5]  # trailing fields: see the document
    ids = struct.unpack(f"<{num_rows * num_cols}i", token_ids)
    values = struct.unpack(f"<{num_rows * num_cols}f", logprobs)
    rank_values = struct.unpack(f"<{num_rows}i", ranks)
    return [
        (
            list(ids[r * num_cols : (r + 1) * num_cols]),
            list(values[r * num_cols : (r + 1) * num_cols]),
            rank_values[r],
        )
        for r in range(num_rows)
    ]


class DocClient:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        routing_id = uuid.uuid4().bytes
        self.sockets = []
        for suffix in (".in", ".out"):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address + suffix)
            self.sockets.append(sock)

    def send(self, message: list) -> None:
        self.sockets[0].send(msgpack.encode(message))

    def receive(self, timeout_s: float) -> list | None:
        if self.sockets[1].poll(int(timeout_s * 1000)):
            return msgpack.decode(self.sockets[1].recv())
        return None

    def handshake(self, model_dir: str) -> list:
        for _ in range(40):
            self.send(["hello", 6, fingerprint(model_dir)])  # the document's protocol version
            reply = self.receive(0.5)
            if reply is not None and reply[0] == "ready":
                return reply
        raise AssertionError("no reply to hello")

    def run(self, requests: list[list]) -> dict[str, list]:
        """Sends the requests in one frame; returns each one's outputs once all have finished."""
        self.send(["add", requests])
        outputs: dict[str, list] = {r[0]: [] for r in requests}
        deadline, last_beat = time.monotonic() + 60, 0.0
        while any(not o or o[-1][4] is None for o in outputs.values()):
            assert time.monotonic() < deadline
            if time.monotonic() - last_beat > 1.0:
                self.send(["beat"])
                last_beat = time.monotonic()
            message = self.receive(0.1)
            if message is not None and message[0] == "out":
                for output in message[1]:
                    outputs[output[0]].append(output)
        return outputs

    def close(self) -> None:
        self.send(["bye"])
        self.ctx.destroy(linger=200)


@pytest.fixture(scope="module")
def daemon(tiny_path, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('doc')}/core"
    with running_daemon(tiny_path, address, "--log-level", "WARNING"):
        yield address


def test_a_client_from_the_document_alone_gets_what_llm_gets(daemon, tiny_path, llm_inproc, tokenizer):
    from coreserve import SamplingParams  # only to compute the expected result

    client = DocClient(daemon)
    try:
        reply = client.handshake(tiny_path)
        assert reply[2] is None and reply[3] == 50257 and reply[6] == [50256]
        prompts = [tokenizer(p).input_ids for p in PROMPTS[:2]]
        sampling = {"temperature": 0.0, "max_tokens": 6, "logprobs": 3, "prompt_logprobs": 2, "ignore_eos": True}
        outputs = client.run([[f"q{i}", p, sampling, time.time()] for i, p in enumerate(prompts)])
        expected = llm_inproc.generate(prompts, SamplingParams(**sampling), use_tqdm=False)
        for i, exp in enumerate(expected):
            got = outputs[f"q{i}"]
            assert [t for o in got for t in o[1]] == exp.outputs[0].token_ids
            assert got[-1][4] == 1 and got[-1][5] is None  # finish_reason length, no stop_reason
            rows = [row for o in got if o[2] is not None for row in logprob_rows(o[2])]
            assert len(rows) == 6
            for (ids, values, rank), position in zip(rows, exp.outputs[0].logprobs):
                assert ids[0] in position and position[ids[0]].rank == rank
                for token_id, value in zip(ids, values):
                    assert value == pytest.approx(position[token_id].logprob, abs=1e-5)
            prompt_rows = logprob_rows(got[0][3])
            assert len(prompt_rows) == len(prompts[i]) - 1 and got[1][3] is None
            for (ids, values, _), position in zip(prompt_rows, exp.prompt_logprobs[1:]):
                assert ids[0] in position and values[0] == pytest.approx(position[ids[0]].logprob, abs=1e-5)
        client.send(["getstats", 9])
        deadline = time.monotonic() + 10
        while (message := client.receive(1.0)) is None or message[0] != "stats":
            assert time.monotonic() < deadline
        assert message[1] == 9 and message[2] == message[3] == 0 and message[4] == message[5]
    finally:
        client.close()


def test_a_malformed_request_is_refused_with_its_id_and_reason(daemon, tiny_path):
    client = DocClient(daemon)
    try:
        client.handshake(tiny_path)
        outputs = client.run([["bad", [1, 2], {"max_tokens": -3}, 0.0], ["good", [1, 2], {"max_tokens": 2}, 0.0]])
        assert outputs["bad"][-1][4] == 3 and "max_tokens" in outputs["bad"][-1][6]
        assert sum(len(o[1]) for o in outputs["good"]) == 2
    finally:
        client.close()  # a failed check must not leave a context behind (its term would wait)


def test_the_client_imports_nothing_of_coreserve():
    """Only the reference result (inside a test) uses the frontend; the client is the document's."""
    import ast

    tree = ast.parse(Path(__file__).read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert "coreserve" not in top
