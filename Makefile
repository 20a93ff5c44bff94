PY ?= python3
BENCH_CKPT ?= $(or $(TMPDIR),/tmp)/dsuf-flash2

.PHONY: test lint pytest serve gpu-test gpu-test-fallbacks gpu-memcheck gpu-memcheck-model gpu-memcheck-tp gpu-bench gpu-ab gpu-ab-decode \
	gpu-ab-prefill gpu-ab-decode-apart bench-ckpt gpu-stream-sweep

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
GPU_TESTS = tests/gpu/test_gpu_ops.py tests/gpu/test_gpu_sampling.py tests/gpu/test_gpu_model.py tests/gpu/test_gpu_tp.py tests/gpu/test_gpu_tools.py

gpu-test:
	$(PY) -m pytest -q -s $(GPU_TESTS)

# The older paths kept behind flags (=0) for A/B timing, all off, through the model and
# tensor-parallel tests (their kernel tests in test_gpu_ops.py force both ways).
FALLBACKS = DSUF_FUSED_NORM_ROPE=0 DSUF_INDEXER_LANES=0 DSUF_TP_GRAPHS=0 DSUF_ATTEND_ROWS=0 DSUF_SPARSE_PREFILL=0 \
	DSUF_INDEXER_TC=0 DSUF_ATTEND_TC=0 DSUF_GEMM_TC=0 DSUF_MOE_DEVICE_LARGE=0 DSUF_SIDE=0

gpu-test-fallbacks:
	$(FALLBACKS) $(PY) -m pytest -q -s tests/gpu/test_gpu_model.py tests/gpu/test_gpu_tp.py

# (--report-api-errors no: cuda.bindings probes driver entry points through cuGetProcAddress, which
# memcheck would count as errors; memory errors still fail the run.) DSUF_DIRECT_ALLOC=1 gives every
# array its own allocation so memcheck sees its bounds; the canary's planted overrun must be reported
# first, or a clean run would prove nothing.
MEMCHECK = DSUF_DIRECT_ALLOC=1 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1

gpu-memcheck:
	! $(MEMCHECK) $(PY) tools/dev/memcheck_canary.py
	$(MEMCHECK) $(PY) -m pytest -q tests/gpu/test_gpu_ops.py tests/gpu/test_gpu_sampling.py

# One process per test, each with its own ERROR SUMMARY line, so that a device call cut short still
# reports every test it finished (H200: the model tests past 315 s in one process at stop 27, cut
# before their summary; the TP tests ~150-270 s one by one, past 560 s in one process at stop 26).
# MEMCHECK_K selects tests (pytest -k), e.g. MEMCHECK_K="greedy or flash" to split the model file.
MEMCHECK_EACH = for t in $$($(PY) -m pytest -q --collect-only $(1) $(if $(MEMCHECK_K),-k "$(MEMCHECK_K)") | grep '::'); do \
		$(MEMCHECK) $(PY) -m pytest -q "$$t" || exit 1; done

gpu-memcheck-model:
	$(call MEMCHECK_EACH,tests/gpu/test_gpu_model.py)

gpu-memcheck-tp:
	$(call MEMCHECK_EACH,tests/gpu/test_gpu_tp.py)

gpu-bench: bench-ckpt
	$(PY) dsuf.py bench --ckpt $(BENCH_CKPT) --batches 1,8,32 --prefill 4096,65536 --chunk 4096

# The default's figures and each variant's beside them, on the bench checkpoint: decode graphs (b1, 8,
# 32) for the decode-side fallback flags and the opt-in paths not yet measured, prefill 4096 / 65536
# for the prefill-side flags, in one process (dsuf.py bench --variants: one checkpoint load, each
# variant's graphs captured anew); DECODE_AB / PREFILL_AB select a subset; commas join the settings
# of one run.
BENCH_DECODE = $(PY) dsuf.py bench --ckpt $(BENCH_CKPT) --batches 1,8,32 --prefill 0 --no-linears --steps 20
BENCH_PREFILL = $(PY) dsuf.py bench --ckpt $(BENCH_CKPT) --batches 1 --prefill 4096,65536 --no-linears --steps 5
# (stop 27's fallbacks and opt-ins; stop 28's opt-in fusions and forks, alone, then all together;
# e.g. make gpu-ab-decode DECODE_AB='$(DECODE_AB_28)')
DECODE_AB_27 = DSUF_FUSED_NORM_ROPE=0 DSUF_INDEXER_LANES=0 DSUF_SIDE=0 DSUF_GEMVR_FP4=u6 DSUF_GEMVR_FP4=e4 \
	DSUF_GEMVR_FP4=e4u6 DSUF_SHARED_LATE=1 DSUF_MIXES_LATE=1 DSUF_ATT_MIN_SPLIT=16 DSUF_ATT_MIN_SPLIT=32 \
	DSUF_SIDE_BLOCKS_PER_SM=1 DSUF_SIDE_BLOCKS_PER_SM=2 DSUF_TIGHT_BLOCKS=1
DECODE_FUSED = DSUF_FUSED_EXPAND=1,DSUF_ROUTE_GROUP=1,DSUF_FUSED_SCATTER=1,DSUF_ATT_DEROPE=1,DSUF_ENGRAM_EARLY=1,$\
	DSUF_FUSED_ACT=1,DSUF_XPROJ_EARLY=1,DSUF_PREPARE_NEXT=1
DECODE_AB_28 = DSUF_FUSED_EXPAND=1 DSUF_ROUTE_GROUP=1 DSUF_FUSED_SCATTER=1 DSUF_ATT_DEROPE=1 DSUF_ENGRAM_EARLY=1 \
	DSUF_FUSED_ACT=1 DSUF_XPROJ_EARLY=1 DSUF_PREPARE_NEXT=1 $(DECODE_FUSED)
DECODE_AB ?= $(DECODE_AB_27) $(DECODE_AB_28)
PREFILL_AB ?= DSUF_SPARSE_PREFILL=0 DSUF_INDEXER_TC=0 DSUF_ATTEND_TC=0 DSUF_GEMM_TC=0 DSUF_MOE_DEVICE_LARGE=0

gpu-ab: gpu-ab-decode gpu-ab-prefill

bench-ckpt:
	test -f $(BENCH_CKPT)/config.json || $(PY) dsuf.py tiny-model $(BENCH_CKPT) --arch v41 \
		--preset v41-flash-shaped --layers 2 --vocab 8192

gpu-ab-decode: bench-ckpt
	$(BENCH_DECODE) --variants "$(DECODE_AB)" | grep -E "^==|^ +[0-9]+ "

gpu-ab-prefill: bench-ckpt
	$(BENCH_PREFILL) --variants "$(PREFILL_AB)" | grep -E "^==|^prefill"

# The same runs one process each (flags read at import, as the server reads them): to check that an
# in-process A/B ranks the paths alike.
gpu-ab-decode-apart: bench-ckpt
	@echo "== decode, default"; $(BENCH_DECODE) | tail -4
	@for v in $(DECODE_AB); do echo "== decode, $$v"; env $$(echo $$v | tr , ' ') $(BENCH_DECODE) | tail -4; done

# tools/stream_chain.py's tensor-core consumers (FP8: gemvr's f16 MMA, e4m3 MMA; FP4: e4m3, gemvr's)
# by the depth of each warp's ring of units in flight: does a deeper ring stream a chain of
# dependent GEMVs near the copy rate, which FP4 arithmetic is faster once loads are not the bound,
# and what waiting per 128-row group of the input (--fine) saves over whole-GEMV waits? (~7 minutes
# on an H200; `make gpu-test` checks each mode against numpy.)
gpu-stream-sweep:
	@for m in 2 3 4 5; do for u in 2 3 4 6; do for f in "" --fine; do echo "== mode $$m, $$u units $$f"; \
		$(PY) tools/stream_chain.py --mode $$m --units $$u $$f --per-sm 2,3,4 --ahead 0 | tail -n +2; done; done; done
