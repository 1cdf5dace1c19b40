"""vLLM's module names over coreserve, for programs written against vLLM's offline API, such as
lm-eval's in-process backend (`lm_eval --model vllm`). Nothing of vLLM is installed or imported.

    python -m coreserve.frontend.vllm_shim -m lm_eval --model vllm --model_args pretrained=FOLDER,dtype=float32 ...

or, in Python, `coreserve.frontend.vllm_shim.install()` before the program imports `vllm`. `install()` puts a
`vllm` package into `sys.modules` (with `vllm.lora.request`, `vllm.tokenizers`, `vllm.renderers.hf`,
`vllm.inputs`, `vllm.outputs`, `vllm.sampling_params`: what lm-eval imports, and the names users do) and
makes `importlib.metadata.version("vllm")` answer VLLM_API_VERSION, the vLLM whose API this follows.
It refuses to install where a real vLLM is importable. `vllm.LLM` is coreserve's `LLM`, taking the
vLLM engine arguments lm-eval passes: at their defaults they are accepted (they change nothing here),
otherwise refused by name; the rest (LoRA's among them: docs/lora.md) go to coreserve, which refuses what it does
not know. docs/rl.md ("Evaluation").
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import runpy
import sys
import types
from importlib.machinery import ModuleSpec
from types import SimpleNamespace

from coreserve.frontend.engine.engine_args import load_tokenizer
from coreserve.frontend.llm import LLM as CoreserveLLM
from coreserve.frontend.lora import LoRARequest
from coreserve.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from coreserve.protocol.sampling_params import SamplingParams

VLLM_API_VERSION = "0.11.0"

# vLLM engine arguments lm-eval always passes, taken at these values (which change nothing here)
_NO_OP_ARGS = {
    "revision": None,
    "tokenizer_revision": None,
    "tokenizer_mode": "auto",
    "trust_remote_code": False,
    "quantization": None,
}


class LLM(CoreserveLLM):
    """coreserve's LLM under vLLM's constructor: `LLM(model, **vllm_engine_args)`."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        super().__init__(model, **_coreserve_args(model, engine_args))

    @property
    def llm_engine(self) -> SimpleNamespace:
        """What programs read from vLLM's engine object: its model config's length and name."""
        config = SimpleNamespace(max_model_len=self.facts.max_model_len, model=self.config.model)
        return SimpleNamespace(model_config=config)


def _coreserve_args(model: str | None, args: dict) -> dict:
    args = dict(args)
    for name, default in _NO_OP_ARGS.items():
        if name in args and args.pop(name) != default:
            raise ValueError(f"{name}: only {default!r} is supported by coreserve's vLLM shim")
    tokenizer = args.pop("tokenizer", None)
    if tokenizer not in (None, model):
        raise ValueError(
            "tokenizer: coreserve uses the model's own tokenizer; a separate one is not supported"
        )
    return {name: value for name, value in args.items() if value is not None}  # None: the engine's default


def TokensPrompt(**fields) -> dict:  # noqa: N802 (vLLM's TypedDict is called like a class)
    return dict(fields)


def get_tokenizer(
    tokenizer_name: str,
    *,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    **kwargs,
):
    """The model's tokenizer as coreserve loads it (a GGUF file's included)."""
    if tokenizer_mode != "auto" or trust_remote_code or revision is not None:
        raise ValueError("get_tokenizer: tokenizer_mode 'auto', no remote code and no revision only")
    if kwargs:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_name, **kwargs)
    return load_tokenizer(tokenizer_name)


def resolve_chat_template(
    tokenizer=None, chat_template: str | None = None, tools=None, **kwargs
) -> str | None:
    return chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)


_MODULES = {
    "vllm": dict(
        LLM=LLM,
        SamplingParams=SamplingParams,
        TokensPrompt=TokensPrompt,
        RequestOutput=RequestOutput,
        CompletionOutput=CompletionOutput,
        __version__=VLLM_API_VERSION,
    ),
    "vllm.inputs": dict(TokensPrompt=TokensPrompt),
    "vllm.outputs": dict(RequestOutput=RequestOutput, CompletionOutput=CompletionOutput),
    "vllm.sampling_params": dict(SamplingParams=SamplingParams),
    "vllm.logprobs": dict(Logprob=Logprob),
    "vllm.lora": {},
    "vllm.lora.request": dict(LoRARequest=LoRARequest),
    "vllm.tokenizers": dict(get_tokenizer=get_tokenizer),
    "vllm.renderers": {},
    "vllm.renderers.hf": dict(resolve_chat_template=resolve_chat_template),
}


class _Distribution(importlib.metadata.Distribution):
    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_API_VERSION}\nSummary: coreserve's shim\n"
            )
        return None

    def locate_file(self, path):
        return path


class _DistributionFinder(importlib.metadata.DistributionFinder):
    """Answers importlib.metadata's questions about the `vllm` distribution; finds no modules."""

    def find_spec(self, *args, **kwargs) -> None:
        return None

    def find_distributions(self, context=None):
        if context is None or context.name is None or context.name.replace("-", "_").lower() == "vllm":
            yield _Distribution()


def is_installed() -> bool:
    return getattr(sys.modules.get("vllm"), "__coreserve_shim__", False)


def install() -> None:
    """Makes `import vllm` give the shim in this process (idempotent)."""
    if is_installed():
        return
    if "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        raise RuntimeError("a real vllm is importable here: the shim would shadow it, so it is not installed")
    for name, attributes in _MODULES.items():
        module = types.ModuleType(name)
        module.__spec__ = ModuleSpec(name, None, is_package=not attributes or name == "vllm")
        module.__dict__.update(attributes)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    sys.modules["vllm"].__coreserve_shim__ = True
    sys.meta_path.append(_DistributionFinder())


def main(argv: list[str]) -> None:
    """`-m MODULE ARGS...`: runs MODULE as `python -m` would, with the shim installed."""
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit("usage: python -m coreserve.frontend.vllm_shim -m MODULE [ARGS...]")
    install()
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
