# The two set-up commands: `make serve` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
MODEL_ID ?= HuggingFaceTB/SmolLM2-135M-Instruct
PORT ?= 3000
PYTEST_ARGS ?=

.PHONY: serve test lint clean

# The deprecated text-generation client (compatibility tests) pins huggingface-hub<1.0, which
# transformers 5 cannot use; its code runs with either, so it is installed without its pins.
# constraints.txt: the dependency versions the suite last passed with (it says how to renew it).
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e ".[worker,dev]"
	$(VENV)/bin/python -m pip install -q --no-deps "text-generation==0.7.0"
	touch $@

serve: $(VENV)/.installed
	$(VENV)/bin/textgen launch --model-id "$(MODEL_ID)" --port $(PORT)

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check shared services tests
	$(VENV)/bin/ruff format --check shared services tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache
