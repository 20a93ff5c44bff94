PY ?= python3
BENCH_CKPT ?= $(or $(TMPDIR),/tmp)/dsuf-flash2

.PHONY: test lint pytest serve gpu-test gpu-memcheck gpu-memcheck-model gpu-memcheck-tp gpu-bench bench-ckpt

# The README's test command: lint, then the whole suite (GPU tests skip where no GPU is present).
test: lint pytest

lint:
	$(PY) -m ruff check .

pytest:
	$(PY) -m pytest -q tests

serve:
	$(PY) dsuf.py serve

# On a GPU machine: the GPU tests, the same under compute-sanitizer, and the benchmark on a
# full-width V4.1-Flash-shaped 2-layer checkpoint with its DSpark draft layers (written once to
# BENCH_CKPT, ~23 GB).
GPU_TESTS = tests/gpu

gpu-test:
	$(PY) -m pytest -q -s $(GPU_TESTS)

# (--report-api-errors no: cuda.bindings probes driver entry points through cuGetProcAddress, which
# memcheck would count as errors; memory errors still fail the run.) DSUF_DIRECT_ALLOC=1 gives every
# array its own allocation so memcheck sees its bounds; the canary's planted overrun must be reported
# first, or a clean run would prove nothing.
MEMCHECK = DSUF_DIRECT_ALLOC=1 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1

gpu-memcheck:
	! $(MEMCHECK) $(PY) tools/dev/memcheck_canary.py
	$(MEMCHECK) $(PY) -m pytest -q tests/gpu/test_gpu_ops.py tests/gpu/test_gpu_linear.py tests/gpu/test_gpu_norms.py tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_attention.py tests/gpu/test_gpu_sampling.py

# One process per test, each with its own ERROR SUMMARY line, so that a device call cut short still
# reports every test it finished (the model and TP files take minutes under memcheck). MEMCHECK_K
# selects tests (pytest -k), e.g. MEMCHECK_K="greedy or flash" to split the model file.
MEMCHECK_EACH = for t in $$($(PY) -m pytest -q --collect-only $(1) $(if $(MEMCHECK_K),-k "$(MEMCHECK_K)") | grep '::'); do \
		$(MEMCHECK) $(PY) -m pytest -q "$$t" || exit 1; done

gpu-memcheck-model:
	$(call MEMCHECK_EACH,tests/gpu/test_gpu_model.py)

gpu-memcheck-tp:
	$(call MEMCHECK_EACH,tests/gpu/test_gpu_tp.py)

gpu-bench: bench-ckpt
	$(PY) dsuf.py bench --ckpt $(BENCH_CKPT) --batches 1,8,32 --prefill 4096,65536 --chunk 4096

bench-ckpt:
	test -f $(BENCH_CKPT)/config.json || $(PY) dsuf.py tiny-model $(BENCH_CKPT) --arch v41 \
		--preset v41-flash-shaped --layers 2 --vocab 8192
