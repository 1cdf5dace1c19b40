"""The daemon's boundary with real sockets and raw clients: hostile frames, refused clients, floods
and malformed requests each fail alone; the daemon keeps serving everyone else."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest
import zmq
from conftest import PROMPTS, free_blocks_are_all, run_daemon_command, running_daemon

from coreserve import LLM, SamplingParams
from coreserve.protocol import PROTOCOL_VERSION
from coreserve.protocol.codec import Codec
from coreserve.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    GetStats,
    HandshakeReply,
    Hello,
)
from coreserve.protocol.model_facts import tokenizer_fingerprint

NESTED_FRAME = b"\x92\xa4beat" + b"\x91" * 1000 + b"\x90"
OK = SamplingParams(temperature=0.0, max_tokens=4)


class RawClient:
    """A client written against the sockets alone, as an attacker (or a buggy port) would."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.codec = Codec()
        self.routing_id = uuid.uuid4().bytes  # one id on both sockets: outputs are sent to it
        self.socket_in = self._connect(zmq.DEALER, address + ".in")
        self.socket_out = self._connect(zmq.DEALER, address + ".out")

    def _connect(self, kind: int, address: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        sock.connect(address)
        return sock

    def send(self, frame: bytes) -> None:
        self.socket_in.send(frame)

    def hello(self, fingerprint: str, version: int = PROTOCOL_VERSION) -> HandshakeReply:
        for _ in range(20):  # repeated until the core's output socket knows us
            self.send(self.codec.encode(Hello(version, fingerprint)))
            for message in self.receive(0.5):
                if isinstance(message, HandshakeReply):
                    return message
        raise AssertionError("no handshake reply")

    def receive(self, seconds: float) -> list:
        messages, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.socket_out.poll(int(left * 1000) + 1):
                messages.append(self.codec.decode_core(self.socket_out.recv()))
        return messages

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def outputs_of(messages: list) -> list:
    return [o for m in messages if isinstance(m, EngineCoreOutputs) for o in m.outputs]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.fixture(scope="module")
def daemon(tiny_path, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('boundary')}/not/yet/there/core"  # folders are created
    with running_daemon(tiny_path, address, "--log-level", "WARNING") as proc:
        yield address, proc


@pytest.fixture
def raw(daemon):
    client = RawClient(daemon[0])
    yield client
    client.close()


def test_a_deeply_nested_frame_is_dropped_and_a_new_client_attaches_at_once(daemon, tiny_path, raw):
    address, proc = daemon
    raw.send(NESTED_FRAME)
    raw.send(b"\xc1" * 100)
    started = time.monotonic()
    with LLM(tiny_path, core_address=address) as llm:
        assert llm.generate(PROMPTS[0], OK, use_tqdm=False)[0].outputs[0].finish_reason == "length"
    assert time.monotonic() - started < 10 and proc.poll() is None


def test_a_refused_client_gets_no_tokens_and_no_stats(daemon, tiny_path, raw):
    reply = raw.hello("not-the-tokenizer", version=PROTOCOL_VERSION + 7)
    assert reply.error and "protocol version" in reply.error
    request = EngineCoreRequest("x", [1, 2, 3], SamplingParams(max_tokens=3), 0.0)
    raw.send(raw.codec.encode_requests([request]))
    raw.send(raw.codec.encode(GetStats(1)))
    assert raw.receive(1.5) == []
    assert (
        raw.hello("wrong fingerprint").error
        == "the frontend's tokenizer does not match the model's tokenizer"
    )
    raw.send(raw.codec.encode_requests([request]))
    assert outputs_of(raw.receive(1.0)) == []


def test_a_greeted_client_is_served(daemon, tiny_path, raw):
    assert raw.hello(tokenizer_fingerprint(tiny_path)).error is None
    raw.send(
        raw.codec.encode_requests([EngineCoreRequest("x", [1, 2, 3], SamplingParams(max_tokens=3), 0.0)])
    )
    outputs = outputs_of(raw.receive(3.0))
    assert sum(len(o.new_token_ids) for o in outputs) == 3 and str(outputs[-1].finish_reason) == "length"


def test_one_malformed_request_in_a_frame_is_refused_alone_with_its_reason(daemon, tiny_path, raw):
    raw.hello(tokenizer_fingerprint(tiny_path))
    good = [EngineCoreRequest(f"ok-{i}", [1, 2, 3], SamplingParams(max_tokens=2), 0.0) for i in range(2)]
    bad = msgspec.Raw(raw.codec.encode(["bad", [1, 2], {"max_tokens": 2.5}, 0.0]))
    frame = raw.codec.encode_requests(good)
    message = raw.codec.decode_client(frame)
    message.requests.insert(1, bad)
    raw.send(raw.codec.encode(message))
    outputs = outputs_of(raw.receive(3.0))
    refused = [o for o in outputs if o.req_id == "bad"]
    assert len(refused) == 1 and str(refused[0].finish_reason) == "error" and "max_tokens" in refused[0].error
    for req_id in ("ok-0", "ok-1"):
        assert sum(len(o.new_token_ids) for o in outputs if o.req_id == req_id) == 2


def test_a_flood_to_the_output_socket_is_not_kept(daemon, raw):
    address, proc = daemon
    before = rss_mib(proc.pid)
    chunk = b"\0" * (50 * 2**20)
    for _ in range(40):
        raw.socket_out.send(chunk, copy=False)
    time.sleep(2.0)
    assert rss_mib(proc.pid) - before < 200


def test_a_second_daemon_on_a_live_address_is_refused(daemon, tiny_path):
    result = run_daemon_command("--model", tiny_path, "--address", daemon[0])
    assert result.returncode == 2 and "in use by a running engine core" in result.stderr
    assert "Traceback" not in result.stderr


def test_stats_and_service_after_the_abuse(daemon, tiny_path):
    with LLM(tiny_path, core_address=daemon[0]) as llm:
        assert llm.generate(PROMPTS[:3], OK, use_tqdm=False)[2].finished
        assert free_blocks_are_all(llm)
        assert isinstance(llm.get_engine_stats(), EngineStats)
