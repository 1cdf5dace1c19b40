"""EngineConfig: built and validated once in the frontend (or the daemon's command line), then read-only."""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from coreserve.protocol.sampling_params import LogprobsMode


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding (docs/speculative.md), vLLM's `speculative_config` names. Proposals are
    verified by the model at every proposed position in one step, through the batch-invariant kernels,
    so a request gets the same tokens and logprob bits with speculation on as off."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int  # most tokens proposed per request per step
    prompt_lookup_max: int | None = None  # ngram: the longest suffix n-gram looked up in the context
    prompt_lookup_min: int | None = None  # ngram: the shortest
    model: str | None = None  # draft_model: a checkpoint with the same vocabulary, any format the engine loads
    # Requests running at once from which no request speculates (the batch already fills the step)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config model is for method 'draft_model', not 'ngram'")
            low, high = self.lookup_range()
            if not 1 <= low <= high:
                raise ValueError(
                    f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {low}, {high}"
                )
        else:
            if not self.model:
                raise ValueError("speculative_config method 'draft_model' needs model (the draft checkpoint)")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("speculative_config prompt_lookup_min/max are for method 'ngram'")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"speculative_config disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}"
            )

    def lookup_range(self) -> tuple[int, int]:
        """ngram's (shortest, longest) n-gram: one given stands for both, as vLLM; neither: 2 and 5."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return DEFAULT_LOOKUP_RANGE
        return (low if low is not None else high), (high if high is not None else low)


MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP_RANGE = (2, 5)
# vLLM's speculative_config keys and methods that coreserve does not build: refused by name
UNBUILT_SPECULATIVE_KEYS = (
    "draft_tensor_parallel_size", "quantization", "max_model_len", "revision", "code_revision",
    "speculative_token_tree", "draft_model_config", "target_model_config", "enforce_eager",
    "parallel_drafting", "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "disable_padded_drafter_batch",
    "prompt_lookup_num_tokens_per_step",
)


def parse_speculative_config(value: object) -> SpeculativeConfig | None:
    """`speculative_config` as a user gives it (a dict, a JSON string, or the struct): vLLM's names;
    a method or key that is not built is a ValueError naming it. A model without a method is a draft;
    a `builtin:` or hub id draft is resolved to its path."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = dict(_json_object(value, "speculative_config"))
    if value.get("method") is None and value.get("model") is not None:
        value["method"] = "draft_model"
    method = value.get("method")
    if method not in ("ngram", "draft_model"):
        raise ValueError(
            f"speculative_config method {method!r} is not built; coreserve has 'ngram' and 'draft_model'"
        )
    unbuilt = sorted(k for k in value if k in UNBUILT_SPECULATIVE_KEYS)
    unknown = sorted(k for k in value if k not in SpeculativeConfig.__struct_fields__ and k not in unbuilt)
    if unbuilt or unknown:
        raise ValueError(
            f"speculative_config keys not implemented: {unbuilt + unknown}; "
            f"known: {sorted(SpeculativeConfig.__struct_fields__)}"
        )
    if isinstance(value.get("model"), str):  # builtin: made, a hub id fetched (first use: only when named)
        from coreserve.protocol.hub_ids import local_model_path

        value["model"] = local_model_path(value["model"])
    try:
        return msgspec.convert(value, SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad speculative_config: {exc}") from exc


def _json_object(value: object, name: str) -> dict:
    """A config given as a dict or as JSON text, as a dict; a ValueError naming `name` otherwise."""
    if isinstance(value, (str, bytes)):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{name} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (JSON object), got {type(value).__name__}")
    return value


DEFAULT_KV_EVENTS_ENDPOINT = "tcp://127.0.0.1:5557"


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's KVEventsConfig names and rules: the PUB socket binds an endpoint with a wildcard host (`*`,
    `::`) or an ipc:// or inproc:// one, and connects to any other (llm-d's indexer binds, its engines
    connect to it). Unlike vLLM, no endpoint given binds loopback (DEFAULT_KV_EVENTS_ENDPOINT), not every
    interface (vLLM's default); a wildcard host must be given to listen beyond this host."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, else "null"
    endpoint: str | None = None  # None: bind DEFAULT_KV_EVENTS_ENDPOINT
    replay_endpoint: str | None = None  # the ROUTER socket answering replay requests; None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark, in messages
    max_queue_size: int = 100_000  # batches waiting for the publisher thread before the newest are dropped
    topic: str = ""  # the first frame of every message (llm-d: "kv@<pod>@<model>")

    def __post_init__(self) -> None:
        if self.buffer_steps < 0 or not 0 <= self.hwm < 2**31 or self.max_queue_size < 1:
            raise ValueError("kv_events_config: buffer_steps must be >= 0, hwm in 0..2**31-1 (0: none), "
                             "max_queue_size >= 1")

    @property
    def is_publishing(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @property
    def publish_to(self) -> tuple[str, bool]:
        """(the PUB socket's endpoint, whether it binds there rather than connects)."""
        if self.endpoint is None:
            return DEFAULT_KV_EVENTS_ENDPOINT, True
        endpoint = self.endpoint
        return endpoint, "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def parse_kv_events_config(value: object) -> KVEventsConfig | None:
    """`kv_events_config` as a user gives it (a dict, JSON text, or the struct), vLLM's names; an unknown
    name or a wrong type is a ValueError naming it."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    value = _json_object(value, "kv_events_config")
    try:
        return msgspec.convert(value, KVEventsConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad kv_events_config: {exc}") from exc


# EngineConfig.kernel_variant's values: coreserve/worker/cpu/kernel_variants.py's SETTINGS (a test keeps them equal)
KernelVariantSetting = Literal["auto", "native", "generic", "avx2", "avx512", "avx512_vnni", "avx512_bf16"]


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Engine arguments; names follow vLLM's engine args where vLLM has one."""

    model: str  # the local folder or file the core loads (a hub id is resolved before: coreserve/protocol/hub_ids.py)
    # The hub revision (branch, tag or commit) of a model given by hub id; None: main
    revision: str | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = (
        None  # None: enough for max_num_seqs full-length sequences, capped by kv_cache_gib
    )
    kv_cache_gib: float = 2.0
    seed: int = 0
    max_logprobs: int = 20  # -1: the whole vocabulary may be asked for
    logprobs_mode: LogprobsMode = "raw_logprobs"
    # "auto": the checkpoint's torch_dtype (an fp16 checkpoint runs in fp32 on the CPU; docs/models.md)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else the CPU
    num_scheduler_steps: int = 1
    enable_prefix_caching: bool = True  # full prompt blocks computed once and shared (docs/decisions.md)
    # A hybrid model's prefix cache keeps its recurrent state every this many blocks of a chain (a hit lands
    # on one: docs/models.md); None: the fewest that keep those snapshots within a quarter of the KV cache
    state_snapshot_blocks: int | None = None
    # torch intra-op threads in the core (in each worker under tensor parallelism); None: torch's default
    num_threads: int | None = None
    # Worker processes, each holding 1/N of every layer's heads and MLP columns (docs/tensor_parallel.md).
    tensor_parallel_size: int = 1
    # The C kernels (decode attention, logprob rows, fused layer steps) on the CPU in fp32, built with
    # the system cc; False: torch's ops only (the CUDA path), e.g. to rule the kernels out of a bug.
    can_use_cpu_kernels: bool = True
    # Which build of the C kernels (docs/install.md, "Kernels in the wheel"): "auto", this CPU's best of the
    # wheel's prebuilt variants, else a first-use -march=native build; "native": always that build; a
    # variant's name: that one on every host (a fleet of mixed CPUs pins one, so routing cannot change bits).
    kernel_variant: KernelVariantSetting = "auto"
    # Each request's logprobs the same bits whatever else runs (batch, prefill chunking, prefix cache,
    # multi-step, thread count) and prompt logprobs equal to generation's, on the C kernels
    # (docs/decisions.md, "Batch invariance"); False: the shape-tuned MKL/AMX products and SDPA prefill.
    batch_invariant: bool = True
    # "int8" (integer mode, opt in): the products of weights kept in GGUF blocks quantize their
    # activations to int8 blocks and sum in integers, in one order, so every bitwise guarantee above
    # holds with numbers near, not equal to, "float32"'s (docs/quantized.md "Integer mode"); CPU kernels only.
    quantized_activations: Literal["float32", "int8"] = "float32"
    # LoRA adapters (docs/lora.md): requests may name a PEFT adapter; at most max_loras adapters run in
    # one step, of rank up to max_lora_rank, and max_cpu_loras stay loaded when idle (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Folders every LoRA adapter's path must lie under, resolved in the core with symlinks followed
    # (--lora-modules, a LoRARequest's lora_path, /v1/load_lora_adapter); None: any path the core can read.
    lora_allowed_roots: tuple[str, ...] | None = None
    # Speculative decoding (docs/speculative.md); None: off. A dict given to LLM/AsyncLLM is converted.
    speculative_config: SpeculativeConfig | None = None
    # KV-cache events for routers (the schema: coreserve/engine_core/kv_events.py; docs/serving.md), vLLM's names; None: none sent.
    kv_events_config: KVEventsConfig | None = None
    # Debugging: every floating torch.empty of the core filled with NaN, so that a buffer a kernel leaves
    # partly unwritten turns the logprobs NaN (coreserve/worker/nan_empties.py); slower, never changes a correct bit.
    fill_empty_with_nan: bool = False
    # Weights holding a NaN or an infinity refused at load, update_weights and wake_up (llama.cpp's
    # --check-tensors, on here); False skips the pass (its cost: docs/untrusted_files.md).
    check_tensors: bool = True
    # vLLM's runner: "generate" (tokens), "pooling" (embed, classify, score: one vector a prompt; docs/serving.md,
    # "Pooling"), or "auto": pooling for a model without a language-model head (*ForSequenceClassification,
    # a bare *Model, a GGUF file naming a pooling_type), else generate. One engine serves one of the two.
    runner: Literal["auto", "generate", "pooling"] = "auto"

    def __post_init__(self) -> None:
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be at least 1, got {self.num_scheduler_steps}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.state_snapshot_blocks is not None and self.state_snapshot_blocks < 1:
            raise ValueError(f"state_snapshot_blocks must be at least 1, got {self.state_snapshot_blocks}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or non-negative, got {self.max_logprobs}")
        if self.kernel_variant not in get_args(KernelVariantSetting):
            raise ValueError(f"kernel_variant must be one of {', '.join(get_args(KernelVariantSetting))}, "
                             f"got {self.kernel_variant!r}")
        if self.quantized_activations == "int8" and (not self.can_use_cpu_kernels or self.device.startswith("cuda")):
            raise ValueError("quantized_activations='int8' runs on the CPU's C kernels only "
                             "(device cpu and can_use_cpu_kernels true)")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.lora_allowed_roots is not None and (not self.lora_allowed_roots or not all(self.lora_allowed_roots)):
            raise ValueError(f"lora_allowed_roots must name at least one folder (None: any path), got "
                             f"{list(self.lora_allowed_roots)}")
        spec = self.speculative_config
        if self.runner == "pooling" and (spec is not None or self.tensor_parallel_size > 1):
            raise ValueError("runner='pooling' with speculative_config or tensor_parallel_size > 1 is not built")
        if self.enable_lora and spec is not None and spec.method == "draft_model":
            raise ValueError("enable_lora with speculative_config method 'draft_model' is not built")
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config method 'draft_model' with tensor_parallel_size > 1 is not built")


# One line of help per engine argument, for every command line that takes them (the daemon's, the server's).
ENGINE_ARG_HELP = {
    "revision": "the Hugging Face hub revision (branch, tag or commit) of a model given by hub id "
    "(default: main)",
    "max_model_len": "longest sequence (prompt + output) in tokens; default: the model's max_position_embeddings",
    "max_num_seqs": "most requests running at once (default 128)",
    "max_num_batched_tokens": "most tokens in one model step, prefill chunks included (default 2048)",
    "block_size": "tokens per KV-cache block (default 16)",
    "num_kv_blocks": "KV-cache blocks; default: enough for max_num_seqs full sequences, capped by kv_cache_gib",
    "kv_cache_gib": "most memory for the KV cache in GiB when num_kv_blocks is not given (default 2.0)",
    "seed": "seed of the engine's sampling for requests without their own (default 0)",
    "max_logprobs": "most logprobs a request may ask for; -1: the whole vocabulary (default 20)",
    "logprobs_mode": "raw_logprobs (the default): log_softmax of the model's logits; processed_logprobs: "
    "after logit_bias, allowed_token_ids, penalties, temperature, top-k/p/min-p; raw_logits and "
    "processed_logits: the logits themselves (raw and processed are the older names of the first two)",
    "dtype": "weights and activations: auto (the checkpoint's; fp16 runs as fp32 on the CPU), float32, "
    "bfloat16 or float16",
    "device": "auto (CUDA when torch sees a GPU, else the CPU), cpu or cuda",
    "num_scheduler_steps": "model steps a decode-only batch runs before the scheduler looks again (default 1)",
    "enable_prefix_caching": "reuse the KV of prompt prefixes computed before (true, the default, or false)",
    "state_snapshot_blocks": "a hybrid model's prefix cache: its recurrent state kept every this many blocks "
                             "(default: snapshots within a quarter of the KV cache)",
    "num_threads": "torch intra-op threads in the core, in each worker with tensor_parallel_size > 1 "
    "(default: torch's choice, shared out among the workers)",
    "tensor_parallel_size": "worker processes that split each layer's heads and MLP columns, one all-reduce "
    "per layer half (gloo on the CPU, NCCL on CUDA; default 1: the model runs in the core)",
    "can_use_cpu_kernels": "true: the C kernels on the CPU in fp32; false: torch's ops only",
    "kernel_variant": "which build of the C kernels: auto (the default: this CPU's best prebuilt variant in "
    "the wheel, else built here with -march=native), native (always built here), or a variant (generic, "
    "avx2, avx512, avx512_vnni, avx512_bf16) on every host: pin one a mixed fleet all runs, so that the "
    "replica a request lands on cannot change its bits (docs/install.md)",
    "speculative_config": "speculative decoding as JSON, vLLM's names: {\"method\": \"ngram\", "
    "\"num_speculative_tokens\": 4} (prompt_lookup_min/max, default 2 and 5) or {\"method\": \"draft_model\", "
    "\"model\": PATH, \"num_speculative_tokens\": 4}; the same tokens and logprobs as without it",
    "batch_invariant": "true (the default): a request's logprobs are the same bits in any batch, chunking "
    "or step, and prompt logprobs equal the sampled ones (C kernels on the CPU); false: shape-tuned products",
    "enable_lora": "serve LoRA adapters (PEFT folders) that requests name (default false; docs/lora.md)",
    "max_loras": "most LoRA adapters in one model step (default 1)",
    "max_lora_rank": "highest LoRA rank an adapter may have (default 16)",
    "max_cpu_loras": "LoRA adapters kept loaded while no request uses them (default: max_loras)",
    "fill_empty_with_nan": "debugging: fill every floating torch.empty of the core with NaN, so memory a kernel "
    "leaves unwritten shows as NaN logprobs (slower; default false)",
    "check_tensors": "refuse weights holding NaN or infinities at load and in weight updates (default true; "
    "false skips the pass, about 7%% of the 1.5B GGUF's load: docs/untrusted_files.md)",
    "lora_allowed_roots": "folders a LoRA adapter's path must lie under (resolved, symlinks followed) for "
    "every load; default: any path the engine core can read, so set it for a server others reach",
    "kv_events_config": "KV-cache events as JSON, vLLM's names: {\"enable_kv_cache_events\": true, "
    "\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\", \"replay_endpoint\": ..., \"topic\": "
    "\"kv@pod@model\", \"buffer_steps\": 10000}: every block the prefix cache stores, evicts or clears",
    "runner": "generate (tokens), pooling (embeddings, classification and scores: /v1/embeddings, /pooling, "
    "/classify, /score, /rerank), or auto (the default: pooling for a *ForSequenceClassification, a bare *Model "
    "or a GGUF file with a pooling_type, else generate)",
    "quantized_activations": "float32 (the default, exact): GGUF weights kept quantized meet fp32 "
    "activations; int8 (integer mode): activations quantized to int8 blocks of 32, integer dot products, "
    "every bitwise guarantee kept, numbers near float32's (docs/quantized.md)",
}
