PY ?= python3
BENCH_CKPT ?= $(or $(TMPDIR),/tmp)/dsuf-flash2

.PHONY: test lint pytest serve gpu-test gpu-test-opt-in gpu-memcheck gpu-bench

# The README's test command: lint, then the whole suite (GPU tests skip where no GPU is present).
test: lint pytest

lint:
	$(PY) -m ruff check .

pytest:
	$(PY) -m pytest -q tests

serve:
	$(PY) dsuf.py serve

# On a GPU machine: the GPU tests, the same under compute-sanitizer, and the benchmark on a
# full-width V4.1-Flash-shaped 2-layer checkpoint (written once to BENCH_CKPT, 15 GB).
GPU_TESTS = tests/test_gpu_ops.py tests/test_gpu_sampling.py tests/test_gpu_model.py tests/test_gpu_tp.py

gpu-test:
	$(PY) -m pytest -q -s $(GPU_TESTS)

# The paths still opt-in (README: not yet made default until they have passed here), all on, through
# the model and tensor-parallel tests (their kernel tests in test_gpu_ops.py force them either way).
OPT_IN = DSUF_FUSED_NORM_ROPE=1 DSUF_INDEXER_LANES=1 DSUF_TP_GRAPHS=1 DSUF_ATTEND_ROWS=1 DSUF_SPARSE_PREFILL=1

gpu-test-opt-in:
	$(OPT_IN) $(PY) -m pytest -q -s tests/test_gpu_model.py tests/test_gpu_tp.py

# (--report-api-errors no: cuda.bindings probes driver entry points through cuGetProcAddress, which
# memcheck would count as errors; memory errors still fail the run)
gpu-memcheck:
	compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $(PY) -m pytest -q -x tests/test_gpu_ops.py tests/test_gpu_sampling.py

gpu-bench:
	test -f $(BENCH_CKPT)/config.json || $(PY) dsuf.py tiny-model $(BENCH_CKPT) --arch v41 \
		--preset v41-flash-shaped --layers 2 --vocab 8192
	$(PY) dsuf.py bench --ckpt $(BENCH_CKPT) --batches 1,8,32 --prefill 4096,65536 --chunk 4096
