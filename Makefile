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

.PHONY: venv proto develop client cuda-toolkit cuda cuda-check run test test-all

venv: $(VENV_STAMP)

$(VENV_STAMP):
	test -x $(PY) || $(PYTHON311) -m venv $(VENV)
	$(PY) -c '$(REQS_PY)' > $(VENV)/.v41-requirements.txt
	$(PY) -m pip install "torch==2.11.*" -r $(VENV)/.v41-requirements.txt
	rm -f $(VENV)/.v41-deps-*
	touch $@

# Python gRPC stubs of proto/v41/v1/engine.proto (grpcio-tools) into python/v41/v1/ (git-ignored, never
# edited). Regenerated when the proto or the generator changes; v41.serve.grpc_gen also regenerates stale
# stubs on import in a source tree.
PROTO_STUBS := python/v41/v1/.engine.proto.sha256
proto: $(PROTO_STUBS)

$(PROTO_STUBS): proto/v41/v1/engine.proto python/v41/serve/grpc_gen.py $(VENV_STAMP)
	$(PY) python/v41/serve/grpc_gen.py

develop: venv proto
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release

# The Rust gRPC client and load generator (target/debug/v41-client; protoc comes from protoc-bin-vendored).
client:
	cargo build -p v41-client

# The optional CUDA extension v41._cuda (cuda/build.py; docs/kernels.md §1 "CUDA kernels"). nvcc: $$CUDA_HOME, the
# PATH, or PyPI's 13.0 toolkit wheels installed here (newer ones target a newer driver than our GPU machine's).
CUDA_WHEELS := "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*"
cuda-toolkit: $(VENV_STAMP)
	@command -v nvcc >/dev/null || test -n "$$CUDA_HOME" || $(PY) -m pip install -q $(CUDA_WHEELS) ninja

cuda: develop cuda-toolkit
	$(PY) cuda/build.py

# Compile every kernel for sm_90a, sm_100a and sm_120a (no GPU, no link).
cuda-check: cuda-toolkit
	$(PY) cuda/build.py --check

# The OpenAI-compatible server on 127.0.0.1:8000 with the embedded tiny model (Ctrl-C stops it).
run: develop
	$(VENV)/bin/v41-serve

PYTEST := V41_TEST=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -n 2 --timeout 600 --durations=25

# CI: everything but the `slow` full matrices (docs/numerics.md §4a: the target is 30 minutes on 2 cores).
test: develop client
	cargo test --workspace --exclude v41-py
	$(PYTEST) -m "not slow" tests

# Everything, slow matrices included (run before resolving an issue).
test-all: develop client
	cargo test --workspace --exclude v41-py
	$(PYTEST) tests
