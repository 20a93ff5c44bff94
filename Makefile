PY ?= python3
BENCH_CKPT ?= $(or $(TMPDIR),/tmp)/dsuf-flash2

.PHONY: test lint pytest serve gpu-test gpu-test-opt-in gpu-test-fallbacks gpu-memcheck gpu-memcheck-model gpu-bench gpu-ab

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

# The older paths kept behind flags (=0) for A/B timing, all off, through the model and
# tensor-parallel tests (their kernel tests in test_gpu_ops.py force both ways).
FALLBACKS = DSUF_FUSED_NORM_ROPE=0 DSUF_INDEXER_LANES=0 DSUF_TP_GRAPHS=0 DSUF_ATTEND_ROWS=0 DSUF_SPARSE_PREFILL=0

gpu-test-fallbacks:
	$(FALLBACKS) $(PY) -m pytest -q -s tests/test_gpu_model.py tests/test_gpu_tp.py

# Paths written and compiled but not yet run on a GPU, so off by default: the model and TP tests
# with them on (their kernel tests in test_gpu_ops.py force them either way).
OPT_IN = DSUF_INDEXER_TC=1 DSUF_PDL_ALL=1 DSUF_GEMM2=1 DSUF_ATTEND_TC=1

gpu-test-opt-in:
	$(OPT_IN) $(PY) -m pytest -q -s tests/test_gpu_model.py tests/test_gpu_tp.py

# (--report-api-errors no: cuda.bindings probes driver entry points through cuGetProcAddress, which
# memcheck would count as errors; memory errors still fail the run.) DSUF_DIRECT_ALLOC=1 gives every
# array its own allocation so memcheck sees its bounds; the canary's planted overrun must be reported
# first, or a clean run would prove nothing.
MEMCHECK = DSUF_DIRECT_ALLOC=1 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1

gpu-memcheck:
	! $(MEMCHECK) $(PY) tools/memcheck_canary.py
	$(MEMCHECK) $(PY) -m pytest -q tests/test_gpu_ops.py tests/test_gpu_sampling.py

gpu-memcheck-model:
	$(MEMCHECK) $(PY) -m pytest -q tests/test_gpu_model.py tests/test_gpu_tp.py

gpu-bench:
	test -f $(BENCH_CKPT)/config.json || $(PY) dsuf.py tiny-model $(BENCH_CKPT) --arch v41 \
		--preset v41-flash-shaped --layers 2 --vocab 8192
	$(PY) dsuf.py bench --ckpt $(BENCH_CKPT) --batches 1,8,32 --prefill 4096,65536 --chunk 4096

# Each opt-in path's figure beside the default's, on the bench checkpoint: decode graphs for the
# decode-side flags, prefill 4096 / 65536 for the prefill-side ones (what decides making one default).
BENCH_DECODE = $(PY) dsuf.py bench --ckpt $(BENCH_CKPT) --batches 1,8,32 --prefill 0 --no-linears --steps 20
BENCH_PREFILL = $(PY) dsuf.py bench --ckpt $(BENCH_CKPT) --batches 1 --prefill 4096,65536 --no-linears --steps 5

gpu-ab:
	test -f $(BENCH_CKPT)/config.json || $(PY) dsuf.py tiny-model $(BENCH_CKPT) --arch v41 \
		--preset v41-flash-shaped --layers 2 --vocab 8192
	@echo "== decode, default"; $(BENCH_DECODE) | tail -4
	@echo "== decode, DSUF_PDL_ALL=1"; DSUF_PDL_ALL=1 $(BENCH_DECODE) | tail -4
	@echo "== prefill, default"; $(BENCH_PREFILL) | tail -2
	@for f in DSUF_INDEXER_TC DSUF_GEMM2 DSUF_ATTEND_TC; do \
		echo "== prefill, $$f=1"; env $$f=1 $(BENCH_PREFILL) | tail -2; done
	@echo "== prefill, all three"; DSUF_INDEXER_TC=1 DSUF_GEMM2=1 DSUF_ATTEND_TC=1 $(BENCH_PREFILL) | tail -2
