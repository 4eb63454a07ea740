# Developer entry points. Everything runs in one virtualenv, .venv (Python 3.11).

PYTHON311 ?= python3.11
VENV      := .venv
PY        := $(VENV)/bin/python
# The dependency install is redone only when pyproject.toml changes.
VENV_STAMP := $(VENV)/.v41-deps-$(shell sha256sum pyproject.toml | cut -c1-16)
# Build requirements, runtime dependencies and the test extra, all read from pyproject.toml.
REQS_PY := import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); \
	print(*d["build-system"]["requires"], *d["project"]["dependencies"], \
	*d["project"]["optional-dependencies"]["test"], sep="\n")

.PHONY: venv develop run test

venv: $(VENV_STAMP)

$(VENV_STAMP):
	test -x $(PY) || $(PYTHON311) -m venv $(VENV)
	$(PY) -c '$(REQS_PY)' > $(VENV)/.v41-requirements.txt
	$(PY) -m pip install "torch==2.11.*" -r $(VENV)/.v41-requirements.txt
	rm -f $(VENV)/.v41-deps-*
	touch $@

develop: venv
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release

run: develop
	$(VENV)/bin/v41 generate --prompt "Hello" --max-tokens 32

test: develop
	cargo test --workspace --exclude v41-py
	V41_TEST=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
		$(PY) -m pytest -q -n 2 --timeout 600 tests
