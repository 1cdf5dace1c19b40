# Two entry points for a fresh machine: `make demo` and `make test` (both set up first).
PY := .venv/bin/python

.PHONY: demo test test-bf16 test-bf16-ci wheel-smoke setup setup-runtime lint
demo: setup-runtime
	HF_HUB_OFFLINE=1 $(PY) scripts/demo.py

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider --durations=30

# The suite again on bf16 copies of its checkpoints; tests marked fp32_exact are skipped (docs/testing.md).
test-bf16: setup
	CORESERVE_TEST_DTYPE=bfloat16 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider

# CI's share of bf16 mode (the whole of it would double CI): against HF, across batch shapes, the server.
BF16_CI_TESTS := tests/test_llm_greedy.py tests/test_logprobs.py tests/test_multi_step.py \
	tests/test_server_completions.py
test-bf16-ci: setup
	CORESERVE_TEST_DTYPE=bfloat16 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider $(BF16_CI_TESTS)

# The built wheel and sdist installed as docs/install.md says, in a fresh venv with no compiler on PATH,
# serving SmolLM2: chat, a required tool call, a runtime LoRA, batch invariance (CI, after the suite).
wheel-smoke: setup
	bash scripts/wheel_smoke.sh

lint: setup
	$(PY) -m ruff check .

# The demo needs the runtime alone; the tests add their extras, tokenizers and real model files.
setup-runtime: .venv/.installed
setup: .venv/.installed-test

.venv/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

.venv/.installed-test: .venv/.installed scripts/real_models.py
	bash scripts/setup.sh --test
	touch $@
