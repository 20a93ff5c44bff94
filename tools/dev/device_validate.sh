#!/usr/bin/env bash
# GPU validation and profiling in device calls that fit the per-call limit: `bash
# tools/dev/device_validate.sh 1|2|3|4|5|6|7|8` from the repo root on the device (carry the wheels in .whl:
# the requirements a device image lacks, llguidance and greenlet, which the tensor-parallel tests need;
# a call carries at most 64 MiB, and the tracked tree takes most of it).
# Every stage has its own timeout, capped by what is left of CAP seconds, and writes a line of summary
# and its log under $OUT, so a call cut short still returns what finished. A finished step's log joins
# $OUT/logs.txt (a device call brings back only a few files); a step cut short leaves its own.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
T0=$(date +%s); CAP=${CAP:-570}; CKPT=${CKPT:-/tmp/ck}
step() {
  local name=$1 lim=$2 left s rc; shift 2
  left=$(( CAP - ($(date +%s) - T0) )); [ "$left" -lt "$lim" ] && lim=$left
  if [ "$lim" -lt 10 ]; then echo "$name skipped (no time)" >> "$OUT/summary.txt"; return; fi
  s=$(date +%s); timeout "$lim" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s" >> "$OUT/summary.txt"
  tail -3 "$OUT/$name.log" >> "$OUT/summary.txt"
  { echo "=== $name (rc=$rc)"; cat "$OUT/$name.log"; } >> "$OUT/logs.txt" && rm "$OUT/$name.log"
}
ckpt() {
  [ -f "$CKPT/config.json" ] || nice python3 dsuf.py tiny-model "$CKPT" --arch v41 --preset v41-flash-shaped \
    --layers 2 --vocab 8192 > /tmp/ckpt.log 2>&1 && sync  # (its writeback would slow the first timings)
}
B="python3 dsuf.py bench --ckpt $CKPT --no-linears --steps 5"
# An A/B runs both trees from copies under /tmp: runs from the repository's own directory on the
# device read slower on the host's side than its copy's, even with the same code.
NEWT=.
if [ -n "${BASE:-}" ]; then rm -rf /tmp/newtree && cp -r . /tmp/newtree && NEWT=/tmp/newtree; fi
FIRST="tests/gpu/test_gpu_fp8_gemm.py tests/gpu/test_gpu_fp8_grouped.py tests/gpu/test_gpu_deepseek_numerics.py
  tests/gpu/test_gpu_spec_sampling.py tests/gpu/test_gpu_sampling.py tests/gpu/test_gpu_speculative.py
  tests/gpu/test_gpu_tp.py"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/summary.txt"
case ${1:-1} in
1)  # the new kernels first (a hang in the GEMM is a barrier bug), then bench under both numerics on the
    # same machine and 1M tokens, then the speculation and TP tests
    ckpt &
    step t1_fp8gemm 90 python3 -m pytest -q -x -s tests/gpu/test_gpu_fp8_gemm.py
    step t2_grouped 70 python3 -m pytest -q -x tests/gpu/test_gpu_fp8_grouped.py
    step t3_dsnum 150 python3 -m pytest -q -s tests/gpu/test_gpu_deepseek_numerics.py
    wait
    step b2_deepseek 200 $B --prefill 4096,65536 --batches 1,8,32 --numerics deepseek --speculative dspark
    step b1_exact 200 $B --prefill 4096,65536 --batches 1,8,32 --numerics exact --speculative dspark
    step b3_1m 120 $B --prefill 1048576 --batches 1 --numerics deepseek --speculative off
    step t4_spec 150 python3 -m pytest -q tests/gpu/test_gpu_spec_sampling.py tests/gpu/test_gpu_sampling.py \
      tests/gpu/test_gpu_speculative.py tests/gpu/test_gpu_tp.py ;;
2)  # the rest of the GPU suite: a call of its own (it outlasts 250 s), each file's slowest tests named
    step t5_rest 540 python3 -m pytest -q -rf --durations=10 tests/gpu $(for f in $FIRST; do echo --ignore "$f"; done) ;;
3)  # memcheck of the new kernels
    step m1_ops 300 make gpu-memcheck
    step m2_fp8 250 env DSUF_DIRECT_ALLOC=1 compute-sanitizer --tool memcheck --report-api-errors no \
      --error-exitcode 1 python3 -m pytest -q tests/gpu/test_gpu_fp8_gemm.py \
      tests/gpu/test_gpu_fp8_grouped.py ;;
4)  # why the FP8 GEMMs run below the MMA rate (Nsight Compute on one launch of each kernel), and a
    # deepseek prompt chunk's device time per kernel name (the MoE's grouped GEMMs against the rest)
    ckpt &
    NCU="ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
      --section WarpStateStats --section SchedulerStats --section LaunchStats --section ComputeWorkloadAnalysis
      --launch-count 1"
    step p1_fp8 120 $NCU -k regex:gemm_e4m3_fp8_sm90 python3 -m pytest -q -s tests/gpu/test_gpu_fp8_gemm.py -k rate
    step p2_fp4 120 $NCU -k regex:gemm_e4m3_fp4_sm90 python3 -m pytest -q -s tests/gpu/test_gpu_fp8_gemm.py -k rate
    wait
    step p0_chunk 150 python3 tools/dev/gpu_profile.py prefill "$CKPT" --context 4096 --chunk 4096 --numerics deepseek
    step p3_grouped 200 $NCU --section SourceCounters -o /tmp/grouped -k regex:gemm_fp4_experts_sm90 $B --prefill 4096 \
      --batches 1 --numerics deepseek --speculative off
    # (-o writes the report instead of printing it): its sections, then where its warps stall,
    # instruction by instruction (the SASS with its stall samples)
    step p4_details 60 ncu --import /tmp/grouped.ncu-rep --page details
    step p5_sass 60 ncu --import /tmp/grouped.ncu-rep --page source --print-source sass --csv ;;
5)  # the demo's draft trained on the GPU (issue 30): the corpus and the main model's targets on the
    # CPUs, then torch on the GPU continuing from the shipped draft; the draft's files come back
    # under $OUT/draft (the main model's shards stay behind: copy them from models/demo-v41)
    W=/tmp/dspark_work
    step d1_data 240 python3 tools/train_dspark.py data --ckpt models/demo-v41 --work $W --workers 14
    step d2_train 300 python3 tools/train_dspark.py train --ckpt models/demo-v41 --work $W --out /tmp/draft \
      --init models/demo-v41 --minutes 4 --device cuda
    mkdir -p "$OUT/draft" && cp /tmp/draft/config.json /tmp/draft/model-dspark.safetensors \
      /tmp/draft/model.safetensors.index.json $W/train.json "$OUT/draft/" 2>> "$OUT/summary.txt" ;;
6)  # a tree against main (or any tree in $BASE, a copy of this one with the other's files over it):
    # the tests of the kernels decode steps and prompt chunks run; then, for this tree and BASE on the
    # same machine, the FP8 GEMMs' rates, a deepseek prompt chunk's device time per kernel and a
    # deepseek decode step's timeline; then bench (prefill, decode and DSpark under deepseek, decode
    # under exact) and where a deepseek verify step and draft block spend their time. E.g. with main's
    # versions of the changed files in .ab/base (`bash tools/dev/ab_base.sh main` here; carry .ab):
    # `cp -r . /tmp/base && cp -r .ab/base/. /tmp/base/ && BASE=/tmp/base bash tools/dev/device_validate.sh 6`
    ckpt &
    step t6_tests 240 python3 -m pytest -q -rf tests/gpu/test_gpu_deepseek_numerics.py tests/gpu/test_gpu_linear.py \
      tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_norms.py tests/gpu/test_gpu_fp8_gemm.py \
      tests/gpu/test_gpu_fp8_grouped.py tests/gpu/test_gpu_speculative.py
    wait
    for tree in $NEWT ${BASE:-}; do
      tag=$([ "$tree" = "$NEWT" ] && echo new || echo base)
      (cd "$tree" && step p6_rate_$tag 60 python3 -m pytest -q -s tests/gpu/test_gpu_fp8_gemm.py -k rate_on &&
        step p6_chunk_$tag 90 python3 tools/dev/gpu_profile.py prefill "$CKPT" --context 4096 \
        --chunk 4096 --numerics deepseek && step p6_decode_$tag 60 python3 tools/dev/gpu_profile.py timeline \
        "$CKPT" --batch 1 --numerics deepseek --what decode)
    done
    step b6_deepseek 150 $B --prefill 4096,65536 --batches 1,8,32 --numerics deepseek --speculative dspark
    step b6_exact 80 $B --prefill 0 --batches 1,8,32 --numerics exact --speculative off
    for w in verify draft; do
      step p6_$w 60 python3 tools/dev/gpu_profile.py timeline "$CKPT" --batch 1 --numerics deepseek --what $w
    done ;;
7)  # a decode-side change against BASE (as stage 6): the decode kernels' tests and the e4m3 GEMV's
    # under memcheck, then for each tree, alternating, bench's decode and DSpark steps (deepseek) and
    # decode (exact), the deepseek decode and verify steps' timelines at b1, and the draft step as
    # served against its graph
    ckpt &
    # T7: the tests to run (default: the decode kernels'); EXACT7=0 skips the exact-numerics bench
    step t7_tests 200 python3 -m pytest -q -rf -x ${T7:-tests/gpu/test_gpu_gemv_q8.py tests/gpu/test_gpu_deepseek_numerics.py
      tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_attention.py tests/gpu/test_gpu_linear.py}
    step m7_q8 120 env DSUF_DIRECT_ALLOC=1 compute-sanitizer --tool memcheck --report-api-errors no \
      --error-exitcode 1 python3 -m pytest -q tests/gpu/test_gpu_gemv_q8.py -k "72 or scale or ring"
    wait
    for tree in $NEWT ${BASE:-} $NEWT ${BASE:-}; do
      tag=$([ "$tree" = "$NEWT" ] && echo new || echo base)
      (cd "$tree" && step b7_${tag}_ds 70 $B --prefill 0 --batches 1,8,32 --numerics deepseek --speculative dspark)
    done
    for tree in $NEWT ${BASE:-}; do
      tag=$([ "$tree" = "$NEWT" ] && echo new || echo base)
      [ "${EXACT7:-1}" = 0 ] || (cd "$tree" && step b7_${tag}_exact 50 $B --prefill 0 --batches 1,8,32 --numerics exact \
        --speculative off)
      for w in decode verify; do
        (cd "$tree" && step p7_${tag}_$w 50 python3 tools/dev/gpu_profile.py timeline "$CKPT" --batch 1 \
          --numerics deepseek --what $w)
      done
      (cd "$tree" && step p7_${tag}_draft 90 python3 tools/dev/gpu_profile.py draft "$CKPT" --numerics deepseek)
    done ;;
8)  # a prefill-side change against BASE (as stage 6): the tests T8, then for each tree the FP8
    # GEMMs' rates and bench's prefill of P8 tokens (deepseek numerics, no speculation, serve's chunk)
    ckpt &
    step t8_tests 200 python3 -m pytest -q -rf ${T8:-tests/gpu/test_gpu_fp8_grouped.py tests/gpu/test_gpu_model.py}
    wait
    for tree in $NEWT ${BASE:-}; do
      tag=$([ "$tree" = "$NEWT" ] && echo new || echo base)
      (cd "$tree" && step r8_${tag} 60 python3 -m pytest -q -s tests/gpu/test_gpu_fp8_gemm.py -k rate_on &&
        step b8_${tag} 150 $B --prefill ${P8:-4096,65536} --batches 1 --numerics deepseek --speculative off)
    done ;;
esac
cat "$OUT/summary.txt"
