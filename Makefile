# Leadtime: `make test` and `make demo` work on a fresh clone; each installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test demo bench lint system-deps clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Debian packages some tests start for real (redis-server, prometheus, wrk for bench load's smoke test); installed
# only where we run as root.
system-deps:
	@if [ "$$(id -u)" = 0 ]; then \
		missing=""; \
		command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
		command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
		command -v wrk >/dev/null 2>&1 || missing="$$missing wrk"; \
		if [ -n "$$missing" ]; then \
			echo "installing$$missing"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		fi; \
	fi

# Three workers on two cores (many tests wait on the servers they start), a file's tests on one of them (they share
# module fixtures: servers, trained models).
test: $(STAMP) system-deps
	$(PY) -m pytest -n 3 --dist loadfile

demo: $(STAMP)
	$(VENV)/bin/leadtime demo

bench: $(STAMP)
	$(VENV)/bin/leadtime bench accuracy --data sharegpt-h200 --accelerator h200-sxm --model qwen3-32b --json
	$(VENV)/bin/leadtime bench coldstart --json
	$(VENV)/bin/leadtime bench coldstart --unseen l40s --json
	$(VENV)/bin/leadtime bench serving --json
	$(VENV)/bin/leadtime bench tls --json
	$(VENV)/bin/leadtime bench sim --json
	$(VENV)/bin/leadtime sim validate --data sharegpt-h200 --accelerator h200-sxm --model qwen3-32b --json
	$(VENV)/bin/leadtime bench retrain --json

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
