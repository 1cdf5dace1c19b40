"""Hugging Face's numbers for the real-model tests, computed cheaply: teacher-forced forwards (one forward
over each engine-generated sequence gives every step's logits, so it checks the greedy token, its argmax,
and the logprobs at once), many sequences per padded forward, lm_head only on the rows asked for, and
the results cached on disk under ~/.cache/coreserve/hf-reference/results/ keyed by a digest of the
model file's bytes, the transformers and torch versions and the exact question (sequences, rows, token
ids). A changed engine output is another question, so a cached answer never stands in for a new one.

Runs in the pytest process. The forwards run on one torch thread: on this shared 2-core machine two
spinning OpenMP threads under load are 5-10x slower than one (docs/testing.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from coreserve.protocol.builtin_model import default_cache_dir

REFERENCE_DIR = default_cache_dir() / "hf-reference"
RESULTS_VERSION = 2  # bump when what a result holds changes (2: untied GGUF outputs kept)
BATCH_TOKENS = 1024  # padded tokens per forward: bounds the activations to a few tens of MB


@dataclass(frozen=True)
class RowScores:
    """HF's answer for one row (the next-token distribution after a prefix of a sequence)."""

    argmax: int  # the greedy token
    top_logprob: float  # its logprob
    logprobs: dict[int, float]  # float64 log_softmax of the logits, for the token ids asked about


def file_digest(path: str) -> str:
    """sha256 of a file's bytes, cached beside the results by (path, size, mtime)."""
    stat = os.stat(path)
    marker = (
        REFERENCE_DIR
        / "digests"
        / hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    )
    if marker.exists():
        return marker.read_text()
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    _write_atomically(marker, digest)
    return digest


def gguf_reference(path: str) -> HFReference:
    """HF's reference for a GGUF file: transformers' own GGUF loader's model of it, keyed by its bytes."""
    return HFReference(f"gguf:{file_digest(path)}", lambda: gguf_reference_folder(path))


def gguf_reference_folder(path: str) -> str:
    """transformers' GGUF loader's model of `path` (it dequantizes to fp32), saved once as a plain folder
    (config, safetensors): the loader takes ~20 s a time, the folder loads in ~2 s."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = REFERENCE_DIR / f"{Path(path).stem}-{file_digest(path)[:16]}-tf{transformers.__version__}-v2"
    if (folder / "model.safetensors").exists():
        return str(folder)
    model = AutoModelForCausalLM.from_pretrained(
        str(Path(path).parent), gguf_file=Path(path).name, dtype=torch.float32
    )
    tmp = folder.with_name(folder.name + f".{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config))
    tied = model.config.tie_word_embeddings  # an untied output (a real Qwen2.5 0.5B's Q8_0 output) is kept
    tensors = {n: t.contiguous() for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        os.rename(tmp, folder)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


class HFReference:
    """transformers' fp32 model of a checkpoint folder, asked teacher-forced questions; the folder is made
    and loaded only when an answer is not cached. `model_key` names the weights (a file digest)."""

    def __init__(self, model_key: str, make_folder: Callable[[], str]) -> None:
        self.model_key = model_key
        self._make_folder = make_folder  # called on the first uncached question only
        self._model = None

    def teacher_forced(
        self, sequences: list[list[int]], wanted: list[dict[int, list[int]]]
    ) -> list[dict[int, RowScores]]:
        """For sequence i (token ids) and each row r in `wanted[i]`: HF's scores of the distribution after
        tokens[: r + 1], with the logprobs of the token ids `wanted[i][r]`."""
        import torch
        import transformers

        wanted = [{r: sorted(set(ids)) for r, ids in w.items()} for w in wanted]
        question = {"version": RESULTS_VERSION, "model": self.model_key, "transformers": transformers.__version__,
                    "torch": torch.__version__, "sequences": sequences,
                    "wanted": [{str(r): ids for r, ids in sorted(w.items())} for w in wanted]}
        digest = hashlib.sha256(json.dumps(question, sort_keys=True).encode()).hexdigest()
        cached = REFERENCE_DIR / "results" / f"{digest}.json"
        if cached.exists():
            return _decode(json.loads(cached.read_text()))
        with one_torch_thread(), torch.no_grad():
            answer = self._score(sequences, wanted)
        _write_atomically(cached, json.dumps(_encode(answer)))
        return answer

    def _score(
        self, sequences: list[list[int]], wanted: list[dict[int, list[int]]]
    ) -> list[dict[int, RowScores]]:
        import torch
        from transformers import AutoModelForCausalLM

        if self._model is None:
            self._model = AutoModelForCausalLM.from_pretrained(
                self._make_folder(), dtype=torch.float32
            ).eval()
        answer: list[dict[int, RowScores]] = [{} for _ in sequences]
        for batch in _batches(sequences):
            width = max(len(sequences[i]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for b, i in enumerate(batch):  # right padding: each row's positions as alone, pads never attended
                ids[b, : len(sequences[i])] = torch.tensor(sequences[i])
                mask[b, : len(sequences[i])] = 1
            hidden = self._model.model(
                input_ids=ids, attention_mask=mask
            ).last_hidden_state  # [batch, width, hidden]
            for b, i in enumerate(batch):
                answer[i] = _rows(self._model, hidden[b], wanted[i])
        return answer


def _rows(model, hidden, wanted: dict[int, list[int]]) -> dict[int, RowScores]:
    import torch

    rows = sorted(wanted)
    logprobs = torch.log_softmax(model.lm_head(hidden[rows]).double(), dim=-1)  # [len(rows), vocab]
    argmax = logprobs.argmax(dim=-1).tolist()
    top = logprobs.max(dim=-1).values.tolist()
    return {
        row: RowScores(argmax[k], top[k], {t: float(logprobs[k, t]) for t in wanted[row]})
        for k, row in enumerate(rows)
    }


def _batches(sequences: list[list[int]]) -> Iterator[list[int]]:
    """Indices of `sequences`, longest first, in groups of at most BATCH_TOKENS padded tokens."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * len(sequences[batch[0]]) > BATCH_TOKENS:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _encode(answer: list[dict[int, RowScores]]) -> list:
    return [
        {str(r): [s.argmax, s.top_logprob, [[t, v] for t, v in s.logprobs.items()]] for r, s in rows.items()}
        for rows in answer
    ]


def _decode(data: list) -> list[dict[int, RowScores]]:
    return [
        {int(r): RowScores(a, top, {int(t): v for t, v in pairs}) for r, (a, top, pairs) in rows.items()}
        for rows in data
    ]


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
