PY ?= python3

.PHONY: test lint fmt serve

test:
	$(PY) -m pytest -q tests

lint:
	$(PY) -m ruff check .

serve:
	$(PY) dsuf.py serve
