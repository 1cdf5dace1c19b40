"""Grammars compiled against the model's tokenizer, off the step loop (engine-core process, the grammar thread).

xgrammar does the work: a `StructuredOutputsParams` becomes a compiled grammar (its token-mask cache
built for this vocabulary) in one worker thread, cached by its canonical text, and each request gets
its own matcher over it. xgrammar and the tokenizer are loaded on the first grammar, in that thread:
a core that never sees one never imports them. docs/structured_outputs.md.
"""

from __future__ import annotations

import functools
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from coreserve.protocol.builtin_model import default_cache_dir
from coreserve.protocol.gguf_header import is_gguf, read_gguf_header
from coreserve.protocol.structured_outputs import StructuredOutputsParams, choice_grammar, grammar_error

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept; the oldest goes first
GGUF_CONVERTER_VERSION = 1  # coreserve/frontend/engine/gguf_tokenizer.py's CONVERTER_VERSION: its cache folders' suffix


class GrammarCompiler:
    """`submit` returns at once; the future holds the compiled grammar, or the ValueError naming what
    is wrong with it."""

    def __init__(self, model: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                if len(self._cache) >= MAX_CACHED_GRAMMARS:
                    self._cache.pop(next(iter(self._cache)))
                future = self._cache[key] = self._pool.submit(self._compile, key)
            return future

    def new_matcher(self, compiled):  # xgrammar.GrammarMatcher
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: tuple[str, str]):
        kind, text = key
        compiler = self._xgrammar_compiler  # built once, in the pool's one thread
        try:
            if kind == "json":
                return compiler.compile_json_schema(text)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(text)))
            return compiler.compile_grammar(text)
        except RuntimeError as exc:  # xgrammar's parse and schema errors
            raise grammar_error(kind, exc) from None

    @functools.cached_property
    def _xgrammar_compiler(self):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            _load_tokenizer(self.model), vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
        )
        return xgrammar.GrammarCompiler(info, max_threads=1)


def _load_tokenizer(model: str):
    """The model's Hugging Face tokenizer: a folder's, or the one a GGUF file carries. For a GGUF file,
    the folder the frontend converted it to (coreserve/frontend/engine/gguf_tokenizer.py, keyed by the same digest) when
    it is there: converting again takes seconds."""
    from transformers import AutoTokenizer

    if not is_gguf(model):
        return AutoTokenizer.from_pretrained(model)
    digest = read_gguf_header(model).tokenizer_digest
    converted = default_cache_dir() / "gguf-tokenizers" / f"{digest}-v{GGUF_CONVERTER_VERSION}"
    if (converted / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(converted))
    source = Path(model).resolve()
    return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
