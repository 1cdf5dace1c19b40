"""What a pooling model computes after its decoder, read once at load (engine-core process): which runner
the engine is (vLLM's "auto" resolved by the model's head), how a prompt's final hidden states become one
vector (mean, first token, last token, or a classifier's last non-pad token as HF picks it), the
sentence-transformers modules after it (coreserve/worker/pooling/st_modules.py), the head's activation and
the facts the handshake gives clients (coreserve/protocol/pooling_params.py's PoolingFacts).

The kinds not built are refused by name: a GGUF file's pooling_type none (an embedding a token) or rank (a
reranker's own head), a sentence-transformers module or mode other than those read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coreserve.protocol.gguf_header import is_gguf, read_gguf_header
from coreserve.protocol.pooling_params import MAX_POOLED_SIZE, PoolingFacts
from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.pooling.st_modules import DenseSpec, read_st_modules

# llama.cpp's enum llama_pooling_type, as a GGUF file's `<arch>.pooling_type` holds it
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
GGUF_UNBUILT = {0: "none (an embedding a token)", 4: "rank (a reranker's classification head, cls.* tensors)"}


@dataclass(frozen=True)
class PoolingSpec:
    task: str  # "embed" or "classify"
    pooling: str  # "mean", "cls", "last", or "last_non_pad" (a classifier: HF's last token that is not the pad)
    dense: tuple[DenseSpec, ...]  # a sentence-transformers folder's Dense layers, in order
    normalizes: bool  # an embedding's default (use_activation None): L2-normalized
    activation: str  # a classifier's default over its labels: "softmax", "sigmoid" or "identity"
    pad_token_id: int | None  # "last_non_pad": the pad id (None: the last token)
    facts: PoolingFacts


def resolve_runner(runner: str, model_dir: str, args: DecoderArgs) -> str:
    """"generate" or "pooling"; "auto" is pooling for a model without an lm_head, a bidirectional one or a
    GGUF file naming a pooling_type. A model the runner cannot serve is refused by name."""
    if runner == "auto":
        has_gguf_pooling = is_gguf(model_dir) and _gguf_pooling_value(model_dir) not in (None, -1)
        runner = "pooling" if args.head != "lm_head" or args.is_bidirectional or has_gguf_pooling else "generate"
    if runner == "generate" and args.is_bidirectional:
        raise ValueError("use_bidirectional_attention=true (an encoder's attention) is served by runner='pooling' "
                         "only (--runner pooling)")
    if runner == "generate" and args.head != "lm_head":
        raise ValueError("this model has no language-model head (a *ForSequenceClassification or a bare *Model): "
                         "serve it with runner='pooling' (--runner pooling)")
    return runner


def pooling_spec(model_dir: str, config: dict, args: DecoderArgs) -> PoolingSpec:
    """The spec of a model the pooling runner serves (its config.json's dict, its args)."""
    if args.head == "score":
        if not is_gguf(model_dir) and (Path(model_dir) / "modules.json").is_file():
            raise ValueError("modules.json beside a classification head (a sentence-transformers module chain "
                             "after a score head) is not built")
        return _classifier(config, args)
    modules = None if is_gguf(model_dir) else read_st_modules(Path(model_dir), args.hidden_size)
    pooling = modules.pooling if modules is not None else _gguf_pooling(model_dir) or "last"
    dense = modules.dense if modules is not None else ()
    size = dense[-1].out_features if dense else args.hidden_size
    facts = PoolingFacts(["embed"], size, [], *_matryoshka(config, size))
    normalizes = modules.normalizes if modules is not None else True  # vLLM's default for an embedding
    return PoolingSpec("embed", pooling, dense, normalizes, "identity", None, facts)


def _classifier(config: dict, args: DecoderArgs) -> PoolingSpec:
    """HF's *ForSequenceClassification: the score head at the last non-pad token; softmax over the labels,
    sigmoid for one label or multi-label, none for regression (vLLM's defaults by problem_type)."""
    problem = config.get("problem_type")
    activation = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(problem)
    if activation is None:
        activation = "sigmoid" if args.num_labels == 1 else "softmax"
    pad = config.get("pad_token_id")
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)):
        raise ValueError(f"pad_token_id={str(pad)[:40]} must be an integer or null")
    id2label = config.get("id2label") or {}
    labels = [str(id2label.get(str(i), f"LABEL_{i}"))[:256] for i in range(args.num_labels)]
    facts = PoolingFacts(["classify"], args.num_labels, labels)
    return PoolingSpec("classify", "last_non_pad", (), False, activation, pad, facts)


def _matryoshka(config: dict, size: int) -> tuple[list[int], bool]:
    """(the widths `dimensions` may take, whether any width is): config.json's matryoshka_dimensions, or
    is_matryoshka (vLLM's keys); neither: `dimensions` is refused."""
    listed = config.get("matryoshka_dimensions")
    if listed is not None:
        if not isinstance(listed, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= min(size, MAX_POOLED_SIZE) for n in listed
        ):
            raise ValueError(f"matryoshka_dimensions must be a list of widths in 1..{size}, got {str(listed)[:80]}")
        return sorted(set(listed)), False
    return [], config.get("is_matryoshka") is True


def _gguf_pooling(model_dir: str) -> str | None:
    """A GGUF file's pooling_type as the pooler's name; None where the file names none."""
    if not is_gguf(model_dir):
        return None
    value = _gguf_pooling_value(model_dir)
    if value is None or value == -1:
        return None
    if value in GGUF_UNBUILT:
        raise ValueError(f"GGUF pooling_type {value}, {GGUF_UNBUILT[value]}, is not built (built: mean, cls, last)")
    if value not in GGUF_POOLING:
        raise ValueError(f"GGUF pooling_type={str(value)[:40]} is not one of llama.cpp's pooling types")
    return GGUF_POOLING[value]


def _gguf_pooling_value(model_dir: str) -> object:
    meta = read_gguf_header(model_dir).metadata
    return meta.get(f"{meta.get('general.architecture', '')}.pooling_type")
