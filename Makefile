# The two set-up commands: `make serve` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
MODEL_ID ?= HuggingFaceTB/SmolLM2-135M-Instruct
PORT ?= 3000
PYTEST_ARGS ?=

.PHONY: serve test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -e ".[worker,dev]"
	touch $@

serve: $(VENV)/.installed
	$(VENV)/bin/textgen launch --model-id "$(MODEL_ID)" --port $(PORT)

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check shared services tests

clean:
	rm -rf $(VENV) .pytest_cache
