# aiserve: `make run` starts the suite on the embedded default model; `make test` tests it.
# Both set everything up on a fresh machine (virtual environment, pinned dependencies,
# generated protos, the model store).

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export AISERVE_HOME ?= $(CURDIR)/var

.PHONY: run test lint curl promtool chromium gxx kernels protos model venv bench bench-peers lock clean

$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed

aiserve/v1/__init__.py: $(VENV)/.installed $(wildcard protos/aiserve/v1/*.proto) scripts/gen_protos.py
	$(PY) scripts/gen_protos.py

protos: aiserve/v1/__init__.py

model: protos kernels
	$(VENV)/bin/aiserve models pull

# The inference service's CPU ops (services/inference/native_ops.py), compiled into the virtual
# environment against its torch; rebuilt only when their sources change.
kernels: $(VENV)/.installed gxx
	$(PY) -m services.inference.native_ops

gxx:
	@command -v $${CXX:-g++} >/dev/null || (apt-get update -qq && apt-get install -y -qq g++)

run: model
	$(VENV)/bin/aiserve run

lint: protos
	$(VENV)/bin/ruff check aiserve services suite tests scripts bench
	$(VENV)/bin/mypy aiserve services suite
	$(VENV)/bin/vulture

test: model lint curl promtool chromium
	$(PY) -m pytest -q -p no:cacheprovider tests

# The HTTP door's SSE test runs curl (tests/integration/test_openai_http.py).
curl:
	@command -v curl >/dev/null || (apt-get update -qq && apt-get install -y -qq curl)

# The alert rules' tests run promtool (tests/unit/test_prometheus_rules.py); Debian's
# prometheus package provides it.
promtool:
	@command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq prometheus)

# The sweep page's tests render and click it in a headless browser (tests/browser.py).
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)

bench: model
	$(PY) -m bench.run

lock:
	sed -n '/^#/p;/^[^#]/q' requirements.lock > requirements.lock.new
	$(PY) -m pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' >> requirements.lock.new
	mv requirements.lock.new requirements.lock

clean:
	rm -rf $(VENV) aiserve/v1

# aiserve against vLLM's CPU build, same machine and prompts (installs it into var/peers first).
bench-peers: model
	$(PY) -m bench.peers
