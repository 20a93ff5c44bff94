PY ?= python3

.PHONY: test lint pytest serve

# The README's test command: lint, then the whole suite (GPU tests skip where no GPU is present).
test: lint pytest

lint:
	$(PY) -m ruff check .

pytest:
	$(PY) -m pytest -q tests

serve:
	$(PY) dsuf.py serve
