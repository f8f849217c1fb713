# moekit's two entry points (README.md): `make bench` and `make test`.
# Both create .venv and install moekit with pinned torch/triton on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.moekit-installed
PYTEST_ARGS ?=

.PHONY: setup bench test test-gpu clean

# numpy 2.4 breaks the Triton 3.6 interpreter (int() of 1-element arrays), hence its cap.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0 triton==3.6.0 "numpy<2.4"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# The main job. On a CUDA GPU: one MoE layer (Llama 4 Scout), moekit vs its peers and the roofline
# floor. Without one: tiny random transformers models generating with moekit vs eager experts,
# tokens checked (CPU times; no kernel timings). `moekit bench --hf ARCH`: a whole model (README).
bench: $(STAMP)
	$(BIN)/moekit bench

# Lint and format check (ruff, configured in pyproject.toml; `ruff format moekit tests benchmarks`
# fixes the format), then the reference and interpreter tiers on the CPU (the GPU tier is skipped
# without CUDA).
test: $(STAMP)
	$(BIN)/ruff check moekit tests benchmarks
	$(BIN)/ruff format --check moekit tests benchmarks
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

# On a CUDA machine with torch and triton already installed (no network): GPU tier + benchmarks.
test-gpu:
	bash scripts/device_session.sh

clean:
	rm -rf $(VENV) .pytest_cache
