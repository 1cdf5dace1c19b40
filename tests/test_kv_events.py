"""KV-cache events (vLLM's --kv-events-config; coreserve/engine_core/kv_events.py, coreserve/engine_core/kv_event_log.py, kv_event_publisher.py), read over a
real ZeroMQ socket by a subscriber written from the schema (tests/kv_subscriber.py): after a mixed load on
a small cache (shared prefixes, generated blocks, evictions, a cache_salt chain, a LoRA adapter's chain, a
reset), the contents the events tell equal the engine's prefix index, content for content; llm-d's keys
(FNV-1a 64 over CBOR of the ids, blocks of 16), derived from the events alone, predict before each request
exactly the prefix the engine then reports read from its cache; the replay socket sends the buffered
batches again from a sequence number on; in both of vLLM's layouts (the engine binds, or connects to a
subscriber bound first, llm-d's) every batch after the first arrives. The config takes vLLM's names and
refuses others by name.
"""

from __future__ import annotations

import random
import socket

import msgspec
import pytest
import torch
import zmq
from conftest import IS_BF16_MODE
from kv_subscriber import Subscriber

from coreserve import LLM, LoRARequest, SamplingParams
from coreserve.engine_core.kv_events import END_OF_REPLAY, KVEventBatch
from coreserve.frontend.engine.engine_args import make_config

BLOCK = 16
SYSTEMS = [[(37 * s + 11 * j) % 4000 + 100 for j in range(40)] for s in range(4)]  # 2.5 blocks each
SALTED_SYSTEM = [(53 * j) % 4000 + 4100 for j in range(40)]  # tokens no unsalted prompt has


def write_adapter(base: str, folder: str) -> None:
    """A small random PEFT adapter (rank 4 on q and v) saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(folder)


def workload(count: int, seed: int) -> list[dict]:
    """Requests in order: a system prompt and a tail of its own, 1 to 20 tokens out; every 6th salted
    (over a system prompt of its own), every 5th on the adapter."""
    rng, requests = random.Random(seed), []
    for i in range(count):
        salted = i % 6 == 5
        system = SALTED_SYSTEM if salted else rng.choice(SYSTEMS)
        tail = [rng.randrange(100, 4000) for _ in range(rng.randint(3, 30))]
        requests.append({"ids": system + tail, "salt": "tenant-a" if salted else None, "lora": i % 5 == 4,
                         "max_tokens": rng.randint(1, 20)})
    return requests


@pytest.mark.skipif(IS_BF16_MODE, reason="the cache's bookkeeping is the same in any dtype")
def test_the_events_rebuild_the_prefix_index_and_llm_ds_keys_predict_every_hit(tiny_path, tmp_path):
    write_adapter(tiny_path, str(tmp_path / "adapter"))
    endpoint, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": replay, "topic": "kv@pod-a@tiny", "buffer_steps": 10_000}
    adapter = LoRARequest("ad", 7, str(tmp_path / "adapter"))
    subscriber = Subscriber({"kv@pod-a@tiny": endpoint}, model="tiny", replays={"kv@pod-a@tiny": replay})
    with subscriber, LLM(tiny_path, multiprocess=False, kv_events_config=config, num_kv_blocks=30,
                         enable_lora=True, max_num_batched_tokens=256) as llm:
        core = llm.engine.client.core
        view, index = subscriber.views["kv@pod-a@tiny"], lambda: core.kv_cache.index

        def caught_up() -> None:  # every batch the engine made so far applied
            subscriber.wait_for("kv@pod-a@tiny", core.kv_publisher.next_seq)
        hits = 0
        for i, request in enumerate(workload(60, seed=4)):
            if i in (30, 45):  # a reset (as a weight update does), a sleep: AllBlocksCleared
                caught_up()
                assert view.blocks
                if i == 30:
                    llm.reset_prefix_cache()
                else:
                    llm.sleep(1)
                    llm.wake_up()
                caught_up()
                assert view.blocks == {} == index().contents()
            if i == 40:  # a new load of the adapter in place: its old load's chains can never be read again
                caught_up()
                removed = view.num_removed
                llm.load_lora_adapter("ad", str(tmp_path / "adapter"), load_inplace=True)
                caught_up()
                assert view.num_removed > removed and view.blocks == index().contents()
            predicted = view.hit_blocks(request["ids"], BLOCK, "ad" if request["lora"] else None)
            prompt = {"prompt_token_ids": request["ids"]}
            if request["salt"]:
                prompt["cache_salt"] = request["salt"]
            params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
            out = llm.generate([prompt], params, use_tqdm=False, lora_request=adapter if request["lora"] else None)[0]
            caught_up()
            if not request["salt"]:  # a salt is not in vLLM's event schema: llm-d keys a salted chain as unsalted
                assert out.num_cached_tokens == BLOCK * predicted, (i, request)
            hits += out.num_cached_tokens > 0
        caught_up()
        assert view.blocks == index().contents()  # the events' contents are the index's, content for content
        assert hits >= 20 and view.lora_names.count("ad") >= 5 and view.num_removed >= 20, (hits, view.num_removed)


def test_replay_sends_the_buffered_batches_from_a_sequence_number(tiny_path, tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay, "buffer_steps": 4}
    with LLM(tiny_path, kv_events_config=config, num_kv_blocks=8) as llm:  # the core in its own process
        for start in range(0, 60, 10):
            llm.generate([{"prompt_token_ids": list(range(100 + start, 140 + start))}],
                         SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)
        context = zmq.Context()
        try:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVTIMEO, 10_000)  # no answer: zmq.Again, not a hang
            dealer.connect(replay)
            dealer.send_multipart([b"", (2).to_bytes(8, "big")])
            replayed = []
            while True:
                assert dealer.poll(10_000), "no answer from the replay socket"
                empty, seq, payload = dealer.recv_multipart()
                if seq == END_OF_REPLAY:
                    assert empty == b"" and payload == b""
                    break
                replayed.append(int.from_bytes(seq, "big"))
                batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
                assert batch.events and batch.ts > 0
            dealer.send_multipart([b"", b"bad"])  # a malformed request is dropped; the socket answers the next
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            again = []
            while (frames := dealer.recv_multipart())[1] != END_OF_REPLAY:
                again.append(int.from_bytes(frames[1], "big"))
        finally:
            context.destroy(linger=0)
    assert len(replayed) == 4 and replayed == sorted(replayed) and replayed[0] >= 2  # the last buffer_steps
    assert again == replayed  # the same buffered batches, nothing from before them


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("engine_binds", [True, False], ids=["engine-binds-ipc", "engine-connects-tcp"])
def test_every_batch_after_the_first_arrives_whichever_side_binds(tiny_path, tmp_path, engine_binds):
    """The engine binds (ipc://) and the subscriber connects; or the subscriber binds loopback TCP first
    and the engine connects (llm-d's indexer), the subscriber not reading while the engine runs. No replay
    socket: where the engine binds, batch 0 alone may be missed (sent as the engine starts); where it
    connects, it holds its batches until the subscription arrives, so none is missed."""
    endpoint = f"ipc://{tmp_path}/kv-events" if engine_binds else f"tcp://127.0.0.1:{free_loopback_port()}"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "kv@pod-a@tiny"}
    subscriber = Subscriber({"kv@pod-a@tiny": endpoint}, model="tiny", binds=not engine_binds)
    with subscriber, LLM(tiny_path, multiprocess=False, kv_events_config=config, num_kv_blocks=8) as llm:
        publisher = llm.engine.client.core.kv_publisher
        assert publisher.config.publish_to == (endpoint, engine_binds)
        if engine_binds:  # what an engine that binds sends before a subscriber connects is a late joiner's gap
            subscriber.wait_connected()
        for start in range(0, 40, 10):  # 40 tokens in, 20 out, on 8 blocks: stores and evictions
            llm.generate([{"prompt_token_ids": list(range(100 + start, 140 + start))}],
                         SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)
        sent = publisher.next_seq
        subscriber.wait_for("kv@pod-a@tiny", sent, timeout_s=10)
        view, contents = subscriber.views["kv@pod-a@tiny"].blocks, llm.engine.client.core.kv_cache.index.contents()
    received = subscriber.received["kv@pod-a@tiny"]
    assert sent >= 6 and publisher.num_dropped == 0 and view == contents
    if engine_binds:  # a connected engine waits for the subscription: batch 0 arrives too
        assert received in (list(range(sent)), list(range(1, sent))), (sent, received)
    else:
        assert received == list(range(sent)), (sent, received)


def test_the_config_takes_vllms_names_and_refuses_others_by_name():
    config = make_config(None, {"kv_events_config": '{"enable_kv_cache_events": true, "topic": "kv@p@m"}'})
    events = config.kv_events_config
    assert events.is_publishing and events.topic == "kv@p@m" and events.publish_to == ("tcp://127.0.0.1:5557", True)
    assert make_config(None, {"kv_events_config": {"endpoint": "ipc:///tmp/kv"}}).kv_events_config.publish_to[1]
    wildcard = "tcp://" + "*" + ":5557"  # parsed only, never bound: vLLM's rule binds a wildcard host
    assert make_config(None, {"kv_events_config": {"endpoint": wildcard}}).kv_events_config.publish_to[1]
    to_indexer = make_config(None, {"kv_events_config": {"endpoint": "tcp://10.0.0.5:5557"}}).kv_events_config
    assert to_indexer.publish_to == ("tcp://10.0.0.5:5557", False)  # vLLM's rule: a named host is connected to
    assert not make_config(None, {"kv_events_config": {"publisher": "null",
                                                       "enable_kv_cache_events": True}}).kv_events_config.is_publishing
    with pytest.raises(ValueError, match="hash_seed"):
        make_config(None, {"kv_events_config": {"enable_kv_cache_events": True, "hash_seed": "0"}})
    with pytest.raises(ValueError, match="not JSON"):
        make_config(None, {"kv_events_config": "{enable"})
    with pytest.raises(ValueError, match="buffer_steps"):
        make_config(None, {"kv_events_config": {"buffer_steps": -1}})


def test_an_endpoint_that_cannot_be_opened_fails_the_start_naming_it(tiny_path):
    bad = {"enable_kv_cache_events": True, "endpoint": "ipc:///no-such-folder/notaport"}
    with pytest.raises(Exception, match="notaport"):
        LLM(tiny_path, multiprocess=False, kv_events_config=bad)
