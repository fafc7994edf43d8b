# Speculative decoding for TorchServe: build, package, serve, test.
# Run `make` (or `make help`) for the list of targets.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pip arguments that install torch. The default is the CPU build; on a CUDA
# machine use e.g.
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
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

# no-archive packages to a folder, the other formats to a .mar file.
ARCHIVE_NAME = $(MODEL_NAME)$(if $(filter no-archive,$(ARCHIVE_FORMAT)),,.mar)
INSTALL_STAMP := $(VENV)/.install-stamp
TORCH_SPEC_FILE := $(VENV)/.torch-spec
TINY_MODELS := models/tiny

.PHONY: help install check-java test tiny-models package serve dev-serve register \
	unregister stop loadtest demo install-demo clean FORCE

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

check-java: ## Check for the Java 17+ runtime TorchServe needs
	@scripts/check_java.sh

# Rewritten only when TORCH_SPEC changes, so that a new TORCH_SPEC reinstalls.
$(TORCH_SPEC_FILE): FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

$(INSTALL_STAMP): requirements.txt requirements-dev.txt scripts/install.sh $(TORCH_SPEC_FILE)
	PYTHON='$(PYTHON)' VENV='$(VENV)' TORCH_SPEC='$(TORCH_SPEC)' scripts/install.sh
	@touch $@

test: install ## Run the whole test suite
	$(PY) -m pytest tests -q -ra $(PYTEST_ARGS)

tiny-models: install ## Build the tiny random target/draft pair into models/tiny
	$(PY) scripts/make_tiny_models.py --out $(TINY_MODELS)

package: install ## Package TARGET+DRAFT+CONFIG as model_store/MODEL_NAME.mar
	@# The tiny pair is built on demand.
	@if [[ "$(TARGET)" == $(TINY_MODELS)/* && ! -f "$(TARGET)/config.json" ]]; then \
		$(MAKE) --no-print-directory tiny-models; fi
	$(PY) scripts/package_mar.py --model-name $(MODEL_NAME) --target $(TARGET) \
		--draft $(DRAFT) --config $(CONFIG) --export-path $(MODEL_STORE) \
		--archive-format $(ARCHIVE_FORMAT) --force

# The server's console output goes to a file: the Java process outlives
# `torchserve --start` and would otherwise hold the terminal (or a pipe) open.
TS_START = mkdir -p logs && $(VENV)/bin/torchserve --start --ncs --model-store $(MODEL_STORE) \
	--ts-config $(TS_CONFIG)

serve: install ## Start TorchServe on 127.0.0.1 (token auth on; keys in key_file.json)
	$(TS_START) > logs/console.log 2>&1 || { cat logs/console.log; exit 1; }
	@echo "TorchServe is starting (console: logs/console.log, log: logs/ts_log.log)."
	@echo "API keys will be in key_file.json. Next: make register"

dev-serve: install ## Like serve, but with token auth OFF (local development only)
	@echo "##################################################################"
	@echo "# WARNING: token authorization is DISABLED. Anyone who can reach #"
	@echo "# 127.0.0.1 on this machine can register models and run code.    #"
	@echo "# Use 'make serve' for anything but local development.           #"
	@echo "##################################################################"
	$(TS_START) --disable-token-auth > logs/console.log 2>&1 || { cat logs/console.log; exit 1; }
	@echo "TorchServe is starting (console: logs/console.log, log: logs/ts_log.log). Next: make register"

register: $(INSTALL_STAMP) ## Register model_store/MODEL_NAME.mar with the running server
	$(PY) scripts/register.py --model-name $(MODEL_NAME) --url $(ARCHIVE_NAME) \
		--management-url $(MANAGEMENT_URL) --inference-url $(INFERENCE_URL)

unregister: $(INSTALL_STAMP) ## Unregister MODEL_NAME from the running server
	$(PY) scripts/register.py --model-name $(MODEL_NAME) --unregister \
		--management-url $(MANAGEMENT_URL) --inference-url $(INFERENCE_URL)

stop: $(INSTALL_STAMP) ## Stop TorchServe
	$(VENV)/bin/torchserve --stop

LOADTEST_ARGS ?= --requests 50 --concurrency 4

loadtest: $(INSTALL_STAMP) ## Load-test MODEL_NAME on the running server (LOADTEST_ARGS)
	$(PY) scripts/loadtest.py --url $(INFERENCE_URL) --model $(MODEL_NAME) $(LOADTEST_ARGS)

install-demo: install
	$(PY) -m pip install -r requirements-demo.txt

demo: install-demo ## Run the demo (scripts/demo.py)
	$(PY) scripts/demo.py

clean: ## Remove the tiny models, archives and no-archive folders in model_store/, and logs
	rm -rf $(TINY_MODELS) logs
	rm -rf $(MODEL_STORE)/*.mar $(MODEL_STORE)/*/

FORCE:
