# Two entry points for a fresh machine: `make demo` and `make test` (both set up first).
PY := .venv/bin/python

.PHONY: demo test setup lint
demo: setup
	HF_HUB_OFFLINE=1 $(PY) scripts/demo.py

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider

lint: setup
	$(PY) -m ruff check .

setup: .venv/.installed

.venv/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@
