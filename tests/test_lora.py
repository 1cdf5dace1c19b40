"""LoRA adapters (docs/lora.md), against PEFT's unmerged forward on the same weights: random PEFT adapters
on the built-in tiny model (every target module, lm_head and embed_tokens included, rslora on and off,
modules_to_save), their logprobs (sampled and prompt) equal PEFT's within the suite's fp32 tolerance; requests of several
adapters and none in one batch equal each alone bit for bit; the prefix cache never hands one adapter's
KV to another; a load in place changes the answers at once; what is not built is refused by name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import HF_TOLERANCE, IS_BF16_MODE, hf_logprobs

from coreserve import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.skipif(IS_BF16_MODE, reason="PEFT's fp32 forward is the reference")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens"]
PROMPTS = [[(11 * i + 7 * j) % 5000 + 50 for j in range(n)] for i, n in enumerate((5, 19, 33, 8, 40, 12))]
# The suite's fp32 tolerance against HF: the base model alone is up to 2.5e-5 from HF's fp32 forward on
# these prompts (the kernels' order of summation), the adapters' requests 1.5e-5 from PEFT's (docs/lora.md)
TOLERANCE = HF_TOLERANCE


def write_adapter(base: str, folder, seed: int, rank: int, alpha: float, targets: list[str], rslora: bool = False,
                  modules_to_save: list[str] | None = None):
    """A PEFT adapter with random A and B (B scaled so the deltas are a few percent of the base's), saved as
    PEFT saves it; returns the PEFT model, for the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                        modules_to_save=modules_to_save, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.mul_(0.05)
            elif "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.02)
    peft_model.save_pretrained(str(folder))
    return peft_model.eval()


@pytest.fixture(scope="module")
def adapters(tiny_path, tmp_path_factory):
    """name -> (folder, PEFT model): every target (rank 8), and q/v with rslora and lm_head saved whole."""
    root = tmp_path_factory.mktemp("lora")
    made = {
        "every": write_adapter(tiny_path, root / "every", 1, 8, 16, ALL_TARGETS),
        "qv-rslora": write_adapter(tiny_path, root / "qv", 2, 4, 8, ["q_proj", "v_proj"], rslora=True,
                                   modules_to_save=["lm_head"]),
    }
    return {name: (str(root / folder), model) for (name, model), folder in zip(made.items(), ("every", "qv"))}


@pytest.fixture(scope="module")
def llm(tiny_path):
    with LLM(tiny_path, multiprocess=False, enable_lora=True, max_loras=3, num_kv_blocks=512,
             max_num_batched_tokens=256) as llm:
        yield llm


def lora(adapters, name: str, int_id: int) -> LoRARequest:
    return LoRARequest(name, int_id, adapters[name][0])


PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, prompt_logprobs=4, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, seed=7, logprobs=3, ignore_eos=True)


def rows(output) -> tuple:
    completion = output.outputs[0]
    return (completion.token_ids, [[(t, v.logprob, v.rank) for t, v in d.items()] for d in completion.logprobs],
            None if output.prompt_logprobs is None else
            [None if d is None else sorted((t, v.logprob) for t, v in d.items()) for d in output.prompt_logprobs])


def worst_from_peft(peft_model, prompt: list[int], output) -> float:
    """The largest |logprob - PEFT's| over a greedy output's prompt and sampled logprobs (each sampled token
    PEFT's argmax, within the tolerance)."""
    completion = output.outputs[0]
    with torch.no_grad():
        reference = hf_logprobs(peft_model, prompt + completion.token_ids)
    worst = 0.0
    for position, entries in enumerate(output.prompt_logprobs[1:], start=1):
        for token_id, value in entries.items():
            worst = max(worst, abs(value.logprob - reference[position - 1][token_id].item()))
    for step, (token_id, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt) - 1 + step]
        assert row[token_id] >= row.max() - TOLERANCE  # greedy: PEFT's argmax
        for entry_id, value in entries.items():
            worst = max(worst, abs(value.logprob - row[entry_id].item()))
    return worst


@pytest.mark.parametrize("name", ["every", "qv-rslora"])
def test_logprobs_equal_peft_unmerged_forward(llm, adapters, name):
    _, peft_model = adapters[name]
    request = lora(adapters, name, 1 if name == "every" else 2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], PARAMS, use_tqdm=False, lora_request=request)
    worst = max(worst_from_peft(peft_model, prompt, output) for prompt, output in zip(PROMPTS, outputs))
    assert worst < TOLERANCE, worst
    with torch.no_grad(), peft_model.disable_adapter():  # the adapter really moves the numbers
        base = hf_logprobs(peft_model, PROMPTS[0])
    assert abs(base[-1] - hf_logprobs(peft_model, PROMPTS[0])[-1]).max() > 1e-3


def test_adapters_and_none_in_one_batch_equal_each_alone(llm, adapters):
    requests = [lora(adapters, "every", 1), lora(adapters, "qv-rslora", 2), None] * 2
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [PARAMS if i % 2 else SAMPLED for i in range(len(PROMPTS))]
    batched = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    assert len({tuple(rows(o)[0]) for o in batched[:3]}) > 1 or rows(batched[0]) != rows(batched[2])
    for i in range(len(PROMPTS)):
        alone = llm.generate([prompts[i]], params[i], use_tqdm=False, lora_request=requests[i])
        assert rows(alone[0]) == rows(batched[i]), i
    llm.reset_prefix_cache()
    cold = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    assert [rows(o) for o in cold] == [rows(o) for o in batched]


def test_the_prefix_cache_keeps_each_adapter_s_kv_its_own(llm, adapters):
    prompt = [{"prompt_token_ids": PROMPTS[4]}]
    llm.reset_prefix_cache()
    base_cold = llm.generate(prompt, PARAMS, use_tqdm=False)
    with_every = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=lora(adapters, "every", 1))
    with_qv = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=lora(adapters, "qv-rslora", 2))
    assert len({str(rows(o[0])) for o in (base_cold, with_every, with_qv)}) == 3
    llm.reset_prefix_cache()
    every_cold = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=lora(adapters, "every", 1))
    assert rows(every_cold[0]) == rows(with_every[0])
    assert rows(llm.generate(prompt, PARAMS, use_tqdm=False)[0]) == rows(base_cold[0])  # warm, the base's blocks


def test_a_load_in_place_changes_the_answers_at_once(tiny_path, adapters, tmp_path):
    second = tmp_path / "second"
    write_adapter(tiny_path, second, 9, 8, 16, ALL_TARGETS)
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    with LLM(tiny_path, multiprocess=False, enable_lora=True, num_kv_blocks=256) as engine:
        int_id = engine.load_lora_adapter("policy", adapters["every"][0])
        assert engine.engine.list_lora_adapters() == [("policy", adapters["every"][0])]
        request = LoRARequest("policy", int_id, adapters["every"][0])
        first = engine.generate(prompt, PARAMS, use_tqdm=False, lora_request=request)
        engine.load_lora_adapter("policy", str(second), load_inplace=True)
        after = engine.generate(prompt, PARAMS, use_tqdm=False, lora_request=request)
        assert rows(after[0]) != rows(first[0])
        with LLM(tiny_path, multiprocess=False, enable_lora=True, num_kv_blocks=256) as fresh:
            expected = fresh.generate(prompt, PARAMS, use_tqdm=False, lora_request=LoRARequest("p", 5, str(second)))
        assert rows(after[0]) == rows(expected[0])  # the new load's numbers, no block of the old one's
        engine.unload_lora_adapter("policy")
        with pytest.raises(ValueError, match="policy"):
            engine.unload_lora_adapter("policy")
        with pytest.raises(ValueError, match="unloaded"):  # a request naming it after: never read again
            engine.generate(prompt, PARAMS, use_tqdm=False, lora_request=request)


def test_what_is_not_built_is_refused_by_name_and_the_engine_goes_on(llm, adapters, tiny_path, tmp_path):
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads(open(os.path.join(adapters["every"][0], "adapter_config.json")).read())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False, lora_request=lora(adapters, "every", 1))
    for request, words in [(LoRARequest("dora", 7, str(dora)), "DoRA"),
                           (LoRARequest("missing", 8, str(tmp_path / "nowhere")), "not found"),
                           (LoRARequest("every", 9, adapters["every"][0]), "belongs to lora_int_id 1"),
                           (LoRARequest("other", 1, adapters["every"][0]), "lora_int_id 1 belongs to the adapter")]:
        with pytest.raises(Exception, match=words):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False, lora_request=request)
    big = tmp_path / "big"
    write_adapter(tiny_path, big, 3, 32, 16, ["q_proj"])
    with pytest.raises(Exception, match="max_lora_rank"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False, lora_request=LoRARequest("big", 10, str(big)))
    assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(tiny_path, multiprocess=False, num_kv_blocks=64) as off, pytest.raises(Exception, match="enable_lora"):
        off.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False, lora_request=lora(adapters, "every", 1))


def test_adapters_are_read_between_steps_and_a_failed_read_fails_only_its_requests(llm, adapters, tmp_path):
    """No adapter is read inside schedule(): a request whose adapter is not resident waits (not failed)
    while the core reads it before the next step, through the runner's add_lora verb; a read that fails
    fails the requests naming that adapter alone, with its error, and the others run."""
    import msgspec

    from coreserve.engine_core.request import RequestStatus
    from coreserve.protocol.messages import EngineCoreRequest, FinishReason
    from coreserve.protocol.sampling_params import LoraRef

    core = llm.client.core  # idle between generate calls: stepped here by hand, as the client would
    schedule, rpc = core.scheduler.schedule, core.executor.collective_rpc
    calls: list[tuple[str, bool]] = []  # (verb, whether schedule() was running)
    in_schedule = [False]

    def watched_schedule():
        in_schedule[0] = True
        try:
            return schedule()
        finally:
            in_schedule[0] = False

    core.scheduler.schedule = watched_schedule
    core.executor.collective_rpc = lambda verb, kwargs: calls.append((verb, in_schedule[0])) or rpc(verb, kwargs)
    gone = LoraRef("gone", 22, str(tmp_path / "nowhere"))
    refs = {"fresh": LoraRef("fresh", 21, adapters["every"][0]), "gone-1": gone, "base": None, "gone-2": gone}
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list] = {req_id: [] for req_id in refs}
    try:
        for req_id, ref in refs.items():
            request = EngineCoreRequest(req_id, PROMPTS[1], msgspec.structs.replace(params, lora=ref), 0.0)
            assert core.add_request(b"by-hand", request) is None
        for step in range(20):
            for batch in core.step().values():
                for output in batch.outputs:
                    outputs[output.req_id].append(output)
            if step == 0:  # asked for, not read yet: waiting, not failed
                assert all(core.scheduler.requests[f"{b'by-hand'.hex()}/{r}"].status == RequestStatus.WAITING
                           for r in ("fresh", "gone-1", "gone-2"))
            if not core.has_unfinished_requests():
                break
    finally:
        core.scheduler.schedule, core.executor.collective_rpc = schedule, rpc
    for req_id in ("gone-1", "gone-2"):
        assert outputs[req_id][-1].finish_reason == FinishReason.ERROR and "not found" in outputs[req_id][-1].error
    for req_id in ("fresh", "base"):
        assert outputs[req_id][-1].error is None and sum(len(o.new_token_ids) for o in outputs[req_id]) == 3
    assert ("add_lora", False) in calls and not any(inside for _, inside in calls)


@pytest.mark.parametrize("build", ["avx2", "generic"])
def test_the_grouped_products_give_the_same_bits_in_every_build_and_batch(kernels, build):
    """csrc/lora_rows.c: the AVX-512 code (where this CPU has it), the AVX2 code and the generic code give
    the same bits, a row's the same alone as among other adapters' rows, and near torch's products."""
    from torch import nn

    from coreserve.worker.cpu.build import NARROWER_BUILDS
    from coreserve.worker.cpu.grouped_lora import CpuGroupedLora
    from coreserve.worker.cpu.kernels import load_cpu_kernels
    from coreserve.worker.lora.adapter import LoraAdapter, LowRank, frozen_linear
    from coreserve.worker.lora.lora_ops import LoraOps

    layer = nn.Linear(100, 70, bias=False)  # widths past whole runs of 16: the tails too

    class Zeros:  # the target's base output: zeros, so the outputs are the deltas alone
        def linear(self, module, x):
            return torch.zeros(x.shape[0], module.out_features) if module is layer else module(x)

    generator = torch.Generator().manual_seed(0)
    adapters = {}
    for slot in range(3):
        adapter = LoraAdapter(f"a{slot}", 8)
        adapter.deltas[layer] = [
            LowRank(frozen_linear(torch.randn(5 + slot, 100, generator=generator)),
                    frozen_linear(torch.randn(width, 5 + slot, generator=generator)), 0.5 + slot, start)
            for start, width in ((0, 37), (37, 33))
        ]
        adapters[slot] = adapter
    x = torch.randn(11, 100, generator=generator)
    slots = torch.tensor([0, 2, -1, 1, 0, 0, 2, 1, 0, -1, 0])

    def run(kernels, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for adapter in adapters.values():
            adapter.packed.clear()
        ops = LoraOps(Zeros(), None, None if kernels is None else CpuGroupedLora(kernels))
        for slot, adapter in adapters.items():
            ops.add(slot, adapter)
        ops.set_rows(rows)
        return ops.linear(layer, x)

    native = run(kernels, slots, x)
    narrow = load_cpu_kernels(extra_flags=NARROWER_BUILDS[build])
    assert torch.equal(run(narrow, slots, x), native)
    for i in range(len(slots)):
        assert torch.equal(run(kernels, slots[i : i + 1], x[i : i + 1]), native[i : i + 1]), i
    assert (native[slots == -1] == 0).all()
    torch.testing.assert_close(run(None, slots, x), native, rtol=1e-5, atol=1e-5)  # torch's products


def test_a_gguf_base_kept_in_blocks_with_fused_projections_equals_peft(family_model, tmp_path):
    """Phi-3's own fused qkv_proj and gate_up_proj as targets, over a GGUF base whose weights stay in Q8_0
    blocks (the adapter in fp32): PEFT's unmerged forward on the blocks' fp32 values is the reference."""
    from gguf_families import write_family_gguf, write_family_twin

    from coreserve.frontend.engine.gguf_tokenizer import gguf_tokenizer_folder
    from coreserve.worker.models.quantized import QuantLinear

    path = tmp_path / "phi3-q8_0.gguf"
    expected = write_family_gguf(family_model("phi3"), "phi3", path, weight_type="Q8_0")
    twin = write_family_twin(tmp_path / "twin", family_model("phi3"), expected, gguf_tokenizer_folder(str(path)))
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    peft_model = write_adapter(twin, tmp_path / "adapter", 4, 8, 16, targets, rslora=True)
    with LLM(str(path), multiprocess=False, enable_lora=True, num_kv_blocks=128) as llm:
        model = llm.client.core.executor.model
        assert isinstance(model.layers[0].qkv_proj, QuantLinear) and isinstance(model.layers[0].gate_up_proj, QuantLinear)
        request = LoRARequest("phi", 1, str(tmp_path / "adapter"))
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], PARAMS, use_tqdm=False,
                               lora_request=request)
    worst = 0.0
    for prompt, output in zip(PROMPTS, outputs):
        reference = hf_logprobs(peft_model, prompt + output.outputs[0].token_ids)
        for position, entries in enumerate(output.prompt_logprobs[1:], start=1):
            worst = max([worst, *(abs(v.logprob - reference[position - 1][t].item()) for t, v in entries.items())])
        for step, entries in enumerate(output.outputs[0].logprobs):
            row = reference[len(prompt) - 1 + step]
            worst = max([worst, *(abs(v.logprob - row[t].item()) for t, v in entries.items())])
    assert worst < TOLERANCE, worst


def test_an_adapter_on_olmo2_equals_peft(family_model, tmp_path):
    """OLMo 2: the adapters' q and k deltas go through its q/k norms over the whole projections, its norms sit on
    attention's and the MLP's outputs only; PEFT's unmerged forward on the folder is the reference."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = write_adapter(family_model("olmo2"), tmp_path / "adapter", 5, 8, 16, targets)
    with LLM(family_model("olmo2"), multiprocess=False, enable_lora=True, num_kv_blocks=128) as llm:
        request = LoRARequest("olmo2", 1, str(tmp_path / "adapter"))
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], PARAMS, use_tqdm=False,
                               lora_request=request)
    worst = max(worst_from_peft(peft_model, prompt, output) for prompt, output in zip(PROMPTS, outputs))
    assert worst < TOLERANCE, worst


class RecordingExecutor:
    """The runner's add_lora and remove_lora verbs as a record (the LoRA table's logic alone): the slots
    loaded, the paths read in order; the path /broken is refused as a missing folder."""

    def __init__(self):
        self.loaded: set[int] = set()
        self.reads: list[str] = []
        self.num_calls = 0

    def collective_rpc(self, verb, kwargs):
        self.num_calls += 1
        if verb == "add_lora" and kwargs["path"] == "/broken":
            raise ValueError("LoRA adapter '/broken' not found")
        if verb == "add_lora":
            self.loaded.add(kwargs["slot"])
            self.reads.append(kwargs["path"])
            return [1]
        assert verb == "remove_lora", verb
        self.loaded.discard(kwargs["slot"])
        return [None]


def test_the_lora_table_keeps_each_request_on_the_load_it_started_with():
    """coreserve/engine_core/lora_table.py with a recording executor (pure logic): a request's adapter is
    read only by load_wanted (between steps), through the runner's add_lora verb; a load in place gives
    new requests a new slot while the running ones keep theirs, the old slot goes with its last request,
    idle loads past max_cpu_loras are dropped and read again when asked for; a failed read is reported
    for its requests alone and its half-loaded slot removed."""
    from types import SimpleNamespace

    from coreserve.engine_core.lora_table import LoraTable
    from coreserve.protocol.sampling_params import LoraRef

    executor = RecordingExecutor()
    table = LoraTable(executor, enabled=True, max_loras=2, max_cpu_loras=1)

    def take(ref: LoraRef) -> int:
        """A request admitted as the scheduler and the core do it: is_ready, then (between steps) the read."""
        req = SimpleNamespace(params=SimpleNamespace(lora=ref), lora_slot=-1)
        table.add_waiter(ref)
        num_calls = executor.num_calls
        if not table.is_ready(req, []):
            assert executor.num_calls == num_calls  # asking for the read reads nothing
            assert table.load_wanted() == [] and table.is_ready(req, [])
        assert table.admit(req) is None
        return req.lora_slot

    running = take(LoraRef("a", 1, "/a"))
    assert take(LoraRef("a", 1, "/a")) == running
    table.load("a", "/a2", inplace=True)
    newer = take(LoraRef("a", 1, "/a"))
    assert newer != running and executor.loaded == {running, newer}
    table.release(running)
    assert executor.loaded == {running, newer}  # one of its two requests still runs
    table.release(running)
    assert executor.loaded == {newer}  # the replaced load lived until its requests had ended
    table.release(newer)
    other = take(LoraRef("b", 2, "/b"))
    table.release(other)  # two idle loads, max_cpu_loras 1: the least recently used goes
    assert executor.loaded == {other}
    again = take(LoraRef("a", 1, "/a"))
    assert again not in (running, newer) and again in executor.loaded  # read again, from the newer path
    assert ("a", "/a2") in table.adapters()
    broken = SimpleNamespace(params=SimpleNamespace(lora=LoraRef("c", 3, "/broken")), lora_slot=-1)
    table.add_waiter(broken.params.lora)
    assert not table.is_ready(broken, [])
    assert table.load_wanted() == [(3, "LoRA adapter '/broken' not found")]
    assert executor.loaded == {other, again} and ("c", "/broken") not in table.adapters()


def test_a_load_read_for_a_waiting_request_is_kept_for_it_and_reads_fit_beside_the_running():
    """coreserve/engine_core/lora_table.py under the real scheduler, stepped as the core does (reads, then
    schedule), no model: a load read for a waiting request is not idle, so the end of another request
    and a control load that trim idle loads leave it until the request is admitted on it, unread again;
    an adapter is read only where it fits beside those running and read (max_loras); a request that
    leaves before its read has none, one that leaves after frees it to the idle loads, and the idle
    loads stay within max_cpu_loras."""
    from test_scheduler import make_request, runner_output

    from coreserve.engine_core.kv_cache_manager import KVCacheManager
    from coreserve.engine_core.lora_table import LoraTable
    from coreserve.engine_core.scheduler import Scheduler
    from coreserve.protocol.sampling_params import LoraRef

    executor = RecordingExecutor()
    table = LoraTable(executor, enabled=True, max_loras=2, max_cpu_loras=1)
    scheduler = Scheduler(KVCacheManager(32, 4), 8, 32, max_model_len=64, loras=table)

    def step(*, can_admit: bool = True):
        for int_id, error in table.load_wanted():
            scheduler.fail_adapter_waiters(int_id, error)
        scheduler.can_admit = can_admit  # False: admissions held (pause_generation), the waiters wait
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output(out, scheduler))

    def add(name: str, int_id: int) -> None:
        scheduler.add_request(make_request(name, 6, max_tokens=30, lora=LoraRef(name, int_id, f"/{name}")))

    add("x", 1)
    step(), step()  # x's read asked for, then done: x runs
    add("a", 2), add("b", 3)
    step()  # a's read asked for; b's not: x, a and b would be three adapters
    step(can_admit=False)
    assert executor.reads == ["/x", "/a"]
    (slot_a,) = executor.loaded - {scheduler.requests["x"].lora_slot}
    scheduler.abort_requests(["x"])  # x's load goes idle: one idle load, max_cpu_loras
    slot_z = table.load("z", "/z").slot  # a second idle load: the least recently used (x's) is trimmed
    assert executor.loaded == {slot_a, slot_z}
    step()  # a admitted on the load read for it; b's read asked for
    assert scheduler.requests["a"].lora_slot == slot_a and executor.reads == ["/x", "/a", "/z"]
    step(can_admit=False)
    assert executor.reads[-1] == "/b" and len(executor.loaded) == 3  # a's, z's (idle), b's
    (slot_b,) = executor.loaded - {slot_a, slot_z}
    scheduler.abort_requests(["b"])  # b leaves after its read: its load is idle, z's trimmed
    assert executor.loaded == {slot_a, slot_b}
    add("c", 4)
    step()  # c's read asked for
    scheduler.abort_requests(["c"])  # c leaves before it: nothing is read for it
    step()
    assert executor.reads == ["/x", "/a", "/z", "/b"] and executor.loaded == {slot_a, slot_b}


def test_an_adapter_trained_on_the_real_smollm2_equals_peft_over_its_q4_1_blocks(tmp_path):
    """A trained adapter on trained weights: PEFT LoRA (rank 8, every projection) trained a few Adam steps on
    the real SmolLM2-135M (transformers' fp32 model of its GGUF), then served over the GGUF kept in its Q4_1
    blocks; the engine's logprobs with the adapter equal PEFT's forward, and differ from the base's. The
    training and PEFT's forwards run on one torch thread: a LoRA step is thousands of small ops, each of
    which waits for the second thread on this shared 2-core machine (48 s of 4 steps on two, 4 on one)."""
    import sys

    from conftest import ROOT
    from hf_reference import gguf_reference_folder, one_torch_thread
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "scripts"))
    from real_models import path_of

    gguf = str(path_of("smollm2-135m"))
    folder = gguf_reference_folder(gguf)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=ALL_TARGETS[:7]))
    tokenizer = AutoTokenizer.from_pretrained(folder) if (Path(folder) / "tokenizer.json").exists() else None
    text = [464, 3139, 286, 4881, 318, 6342, 13, 383, 3139, 286, 4486, 318, 11307, 13] * 3
    ids = torch.tensor([text if tokenizer is None else tokenizer("The capital of France is Paris.").input_ids * 3])
    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=5e-3)
    with one_torch_thread():
        for _ in range(4):
            loss = peft_model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    peft_model.save_pretrained(str(tmp_path / "trained"))
    peft_model.eval()
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 378, 1977, 28, 7018, 30, 2914, 27, 14545]]
    with LLM(gguf, multiprocess=False, enable_lora=True, num_kv_blocks=128) as llm:
        request = LoRARequest("trained", 1, str(tmp_path / "trained"))
        adapted = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False, lora_request=request)
        base = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    worst, moved = 0.0, 0.0
    for prompt, output, plain in zip(prompts, adapted, base):
        with torch.no_grad(), one_torch_thread():
            reference = hf_logprobs(peft_model, prompt + output.outputs[0].token_ids)
        for position, (entries, plain_entries) in enumerate(zip(output.prompt_logprobs[1:], plain.prompt_logprobs[1:]),
                                                            start=1):
            for token_id, value in entries.items():
                worst = max(worst, abs(value.logprob - reference[position - 1][token_id].item()))
            target = prompt[position]
            moved = max(moved, abs(entries[target].logprob - plain_entries[target].logprob))
        for step, entries in enumerate(output.outputs[0].logprobs):
            row = reference[len(prompt) - 1 + step]
            worst = max([worst, *(abs(v.logprob - row[t].item()) for t, v in entries.items())])
    assert worst < TOLERANCE, worst
    assert moved > 0.01  # the trained adapter changes the numbers


def test_speculation_multi_step_and_chunks_change_nothing_with_adapters(tiny_path, adapters):
    """ngram proposals verified with the adapters' deltas, decode windows of 4 steps, prefill in chunks of
    8 tokens: the same bits as plain steps, for requests of two adapters and none in one batch."""
    requests = [lora(adapters, "every", 1), lora(adapters, "qv-rslora", 2), None]
    repeated = [{"prompt_token_ids": (p[:6] * 4)} for p in PROMPTS[:3]]
    # three allowed ids: the greedy output loops, so ngram finds proposals (the logprobs stay raw: whole-vocabulary)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True, allowed_token_ids=[100, 200, 300])
    engines = {"plain": {}, "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
               "multi-step": {"num_scheduler_steps": 4}, "chunks of 8": {"max_num_batched_tokens": 8}}
    results = {}
    for name, extra in engines.items():
        with LLM(tiny_path, multiprocess=False, enable_lora=True, max_loras=2, num_kv_blocks=256, **extra) as llm:
            results[name] = [rows(o) for o in llm.generate(repeated, params, use_tqdm=False, lora_request=requests)]
            if name == "ngram":  # proposals were made and verified with the adapters' deltas
                assert llm.get_engine_stats().spec_num_draft_tokens > 0
    assert all(results[name] == results["plain"] for name in engines), [n for n in engines if results[n] != results["plain"]]


def test_max_loras_one_runs_one_adapter_a_step_and_changes_no_bits(llm, tiny_path, adapters):
    requests = [lora(adapters, "every", 1), lora(adapters, "qv-rslora", 2), None, lora(adapters, "every", 1)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    expected = [rows(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=requests)]
    with LLM(tiny_path, multiprocess=False, enable_lora=True, max_loras=1, num_kv_blocks=256) as one:
        scheduler = one.client.core.scheduler
        seen: list[set] = []
        step = one.client.core.step

        def watched_step():
            seen.append({r.lora_slot for r in scheduler.running if r.lora_slot >= 0})
            return step()

        one.client.core.step = watched_step
        got = [rows(o) for o in one.generate(prompts, PARAMS, use_tqdm=False, lora_request=requests)]
    assert got == expected
    assert max(map(len, seen)) == 1 and len(set().union(*seen)) == 2  # both adapters ran, never together


def test_the_fused_decode_forward_takes_the_adapters_with_the_op_by_op_bits(llm, adapters):
    """Decode steps whose rows run with adapters (no embedding LoRA, no modules_to_save) take the fused
    forward, the deltas added in its threads' region (csrc/decode_forward.c): the same bits as op by op."""
    every_targets = ["q_proj", "v_proj", "down_proj", "lm_head"]
    folder = adapters["every"][0] + "-fusable"
    if not os.path.exists(folder):
        write_adapter(llm.config.model, folder, 5, 8, 16, every_targets)
    requests = [LoRARequest("fusable", 11, folder), lora(adapters, "every", 1), None, LoRARequest("fusable", 11, folder)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    backend = llm.client.core.executor.backend
    taken: list[bool] = []
    step_of = backend.fused.step

    def watched(inputs, with_logits=False, lora=None):
        step = step_of(inputs, with_logits, lora)
        taken.append(step is not None and lora is not None)
        return step

    backend.fused.step = watched
    try:
        fused = [rows(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=requests)]
        fused_fusable = [rows(o) for o in llm.generate([prompts[0], prompts[3]], PARAMS, use_tqdm=False,
                                                       lora_request=[requests[0], requests[3]])]
    finally:
        backend.fused.step = step_of
    assert any(taken)  # the fusable adapter's decode steps ran fused
    kept, backend.fused = backend.fused, None
    try:
        op_by_op = [rows(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=requests)]
        op_fusable = [rows(o) for o in llm.generate([prompts[0], prompts[3]], PARAMS, use_tqdm=False,
                                                    lora_request=[requests[0], requests[3]])]
    finally:
        backend.fused = kept
    assert fused == op_by_op and fused_fusable == op_fusable


def test_async_llm_takes_lora_request_and_equals_llm(llm, tiny_path, adapters):
    """AsyncLLM's LoRARequest: its path resolved (a hub id fetched) in a worker thread, never on the event
    loop; a bad one fails its own stream with a ValueError; the answers equal LLM's."""
    import asyncio
    import threading

    from coreserve import AsyncLLM

    request = lora(adapters, "qv-rslora", 2)
    expected = rows(llm.generate([{"prompt_token_ids": PROMPTS[1]}], PARAMS, use_tqdm=False, lora_request=request)[0])

    async def main():
        engine = AsyncLLM(tiny_path, multiprocess=False, enable_lora=True, num_kv_blocks=128)
        fetch, fetched_on = engine.engine.request_adapter_folder, []
        engine.engine.request_adapter_folder = lambda path: fetched_on.append(threading.get_ident()) or fetch(path)
        try:
            with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
                async for _ in engine.generate({"prompt_token_ids": PROMPTS[1]}, PARAMS, "a", lora_request="qv"):
                    pass
            token_ids, finished = [], False
            async for delta in engine.generate({"prompt_token_ids": PROMPTS[1]}, PARAMS, "a", lora_request=request):
                token_ids += delta.outputs[0].token_ids
                finished = delta.finished
            return token_ids, finished, fetched_on
        finally:
            engine.shutdown()

    token_ids, finished, fetched_on = asyncio.run(main())
    assert finished and token_ids == expected[0]
    assert fetched_on and threading.get_ident() not in fetched_on  # asyncio.run's loop is this thread's


def test_a_bf16_base_takes_the_adapter_in_fp32(tiny_path, adapters):
    """bf16 weights (the CPU's bf16 products round activations to bf16) with an fp32 adapter: near PEFT on
    the same bf16 weights widened to fp32, within the suite's bf16 tolerance, and batch invariant."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.bfloat16).float()
    peft_model = PeftModel.from_pretrained(base, adapters["every"][0]).eval()
    request = lora(adapters, "every", 1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    with LLM(tiny_path, multiprocess=False, dtype="bfloat16", enable_lora=True, num_kv_blocks=128) as bf16:
        batched = bf16.generate(prompts, PARAMS, use_tqdm=False, lora_request=[request, None, request])
        alone = bf16.generate(prompts[2:], PARAMS, use_tqdm=False, lora_request=request)
    assert rows(alone[0]) == rows(batched[2])
    worst = 0.0
    for prompt, output in zip(PROMPTS, batched[:1]):
        reference = hf_logprobs(peft_model, prompt + output.outputs[0].token_ids)
        for step, entries in enumerate(output.outputs[0].logprobs):
            row = reference[len(prompt) - 1 + step]
            worst = max([worst, *(abs(v.logprob - row[t].item()) for t, v in entries.items())])
    assert worst < 0.15, worst  # conftest's bf16 tolerance for the C kernels


def test_two_ranks_with_their_shards_of_the_adapters_equal_peft_and_each_alone(tiny_path, adapters):
    """tensor_parallel_size=2: each rank reads the adapters through the add_lora verb (a RankCall) and keeps
    its shard of each pair (its rows of a q/k/v or gate/up B, its columns of an o or down A; lm_head and
    embed_tokens whole): PEFT's logprobs within the fp32 tolerance, and each request's bits the same alone
    as in one batch with another adapter's rows and the base's."""
    requests = [lora(adapters, "every", 1), lora(adapters, "qv-rslora", 2), None]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    with LLM(tiny_path, tensor_parallel_size=2, num_threads=1, enable_lora=True, max_loras=2, num_kv_blocks=128) as two:
        batched = two.generate(prompts, PARAMS, use_tqdm=False, lora_request=requests)
        alone = [two.generate([p], PARAMS, use_tqdm=False, lora_request=r)[0] for p, r in zip(prompts, requests)]
    assert [rows(o) for o in alone] == [rows(o) for o in batched]
    for name, prompt, output in zip(("every", "qv-rslora"), PROMPTS, batched):
        worst = worst_from_peft(adapters[name][1], prompt, output)
        assert worst < TOLERANCE, (name, worst)


def test_a_made_up_adapter_verb_runs_through_both_tables(llm, adapters, monkeypatch):
    """What a new verb about the adapters takes below the frontend (docs/architecture.md's recipe): a
    function of the runner's control part in RUNNER_VERBS and a row of the core's VERBS; it sees the
    adapters that the add_lora verb read into the runner."""
    from coreserve.engine_core import rl_control
    from coreserve.worker import runner_control

    def adapter_ranks(control) -> list[list]:  # control: the runner's RunnerControl
        return sorted([adapter.name, adapter.rank] for adapter in control.lora.ops.adapters.values())

    monkeypatch.setitem(runner_control.RUNNER_VERBS, "adapter_ranks", runner_control.RunnerVerb(adapter_ranks, False))
    monkeypatch.setitem(rl_control.VERBS, "adapter_ranks", rl_control.Verb(rl_control.NoArgs, rl_control.on_runner("adapter_ranks")))
    prompts = [{"prompt_token_ids": PROMPTS[0]}] * 2
    llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=[lora(adapters, "every", 1), lora(adapters, "qv-rslora", 2)])
    loaded = llm.engine.call("adapter_ranks").result
    assert ["every", 8] in loaded and ["qv-rslora", 4] in loaded
