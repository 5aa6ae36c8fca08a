#!/usr/bin/env bash
# One device call: build, full GPU test suite, sanitizers, benchmarks, ncu bytes, GPT-2 checks, profile.
# Keep what lands in $OUT to 8 files (the device tool returns no more).
# Usage (on the GPU machine, repo root): OUT=/some/dir bash bench/run_gpu.sh [steps...]
# The benchmark steps run their headline cases (bench/conftest.py HEADLINE) unless their *_ARGS hold --full
# (every case: every dtype, shape and provider; the case counts below are the float16 ones).
# BENCH_ARGS narrows the softmax step, e.g. BENCH_ARGS='-k backward' (backward cases only);
# DECODE_ARGS the decode step, e.g. DECODE_ARGS='-k b1-' (batch 1 only) or DECODE_ARGS=--full (adds bfloat16 and the
#   serving shapes); the serving bar's cases alone (bench_decode_attention.py's SERVING_K: 432 cases, 3.5-8.5 min on
#   an H200, see its docstring): DECODE_ARGS=--full DECODE_TIMEOUT=570
#   BENCH_K='(sdpa_flash- or sdpa_cudnn- or paged- or fused-) and (l8192- or l32768- or l131072-)'
#   and the same captured in CUDA graphs (SERVING_GRAPH_K: 432 more cases, a run of its own):
#   BENCH_K='(sdpa_flash_graph- or sdpa_cudnn_graph- or paged_graph- or fused_graph-) and (l8192- or l32768- or l131072-)'
#   or both, each dtype a run, with the bar's counts (bench.serving_bar) after them: the serving step
#   (SERVING_TIMEOUT a run; ~6 min in all on an H200 after the build).
# NORM_ARGS the norm step, e.g. NORM_ARGS='-k layer_norm-add' (add + LayerNorm only) or NORM_ARGS=--full (adds bfloat16).
# ATTN_ARGS the attention step, e.g. ATTN_ARGS='-k causal' or ATTN_ARGS=--full (adds bfloat16).
# LINEAR_ARGS the linear step (bench_linear + bench_mlp), e.g. LINEAR_ARGS='-k m1-' (M = 1 only) or LINEAR_ARGS=--full (adds bfloat16).
# LAYER_ARGS the layer step (bench_layer), e.g. LAYER_ARGS='-k gpt2'.
# PROFILE_ARGS the profile step's bench.profile arguments (default --backends hf-eager,graph), e.g.
#   PROFILE_ARGS='--backends graph-fused --batch-size 16' (its critical_*.txt: what each kernel adds to a step).
# SAMPLE_ARGS the sample step (bench_sample), e.g. SAMPLE_ARGS='-k r1-'.
# SANITIZE_ONLY the sanitize step's case groups, e.g. SANITIZE_ONLY=linear,attention (tests/sanitizer_cases.py --only).
# A/B steps run bench/ab.py: each variant (a name from its VARIANTS: edits of a copy of the tree, built
#   beside the default in its own cache under /tmp/fused_attn_ab) runs the same command as the default.
# AB_VARIANTS: the ab step's variants (space-separated), AB_CMD its command (default: the first variant's),
#   AB_REPEAT its interleaved rounds, AB_TIMEOUT its limit per command, AB_TREES other trees of the project timed
#   beside this one (space-separated NAME=DIR: bench/ab.py's --tree; e.g. a commit exported with git archive).
# GRAPH_AB: the graphab step's variants (space-separated), timed by bench.time_decode_graph with GRAPH_AB_ARGS.
# PDL_TIMEOUT the pdl step's limit per trigger point (its files: PDL_TEST_FILES below).
# FLAG_VARIANTS: the flagtests step's variants: the GPU tests of FLAG_TEST_FILES (default the tensor-core
#   linear's users below) on each variant's library, the correctness half of a variant whose speed the
#   graphab step measures; FLAG_TIMEOUT its limit.
# FUSED_ATTN_COMMIT: the commit of the tree being run (e.g. FUSED_ATTN_COMMIT=$(git rev-parse --short HEAD), set
#   where the tree is committed): the benchmark JSONs' commit_info. The device copy's .git can predate the tree,
#   so without it the JSONs may name an older commit (some stored runs do:
#   history.csv.gz's source column names their tree).
# steps: ab graphab build tests pdl flagtests wide bench decode serving norm attention linear host sample layer sanitize bytes gpt2 gpt2bench profile
# (default: build tests bench decode attention sanitize bytes).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSED_ATTN_CACHE=${FUSED_ATTN_CACHE:-/tmp/fused_attn_cache}
steps=${*:-build tests bench decode attention sanitize bytes}
rc=0
has() { [[ " $steps " == *" $1 "* ]]; }
PDL_TEST_FILES="tests/test_gpt2.py tests/test_decode_attention.py tests/test_sample.py tests/test_linear.py tests/test_layer_norm.py"
log() { echo "== $* ($(date +%T))"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch,transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
[ -n "${FUSED_ATTN_COMMIT:-}" ] && echo "commit (FUSED_ATTN_COMMIT) $FUSED_ATTN_COMMIT" | tee -a "$OUT/gpu.txt" \
  || echo "warning: FUSED_ATTN_COMMIT unset: the JSONs' commit is this copy's .git HEAD, which may predate the tree" | tee -a "$OUT/gpu.txt"

# The SM clock and throttle reasons every second while the steps run, summarized into gpu.txt at the end
# (python -m bench.clocks): at the read peak a second of power capping is the size of a gap between providers.
CLOCKS=$(mktemp /tmp/fused_attn_clocks.XXXXXX)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 1000 > "$CLOCKS" 2>/dev/null &
CLOCKS_PID=$!

if has ab; then
  log "ab (${AB_VARIANTS:-no variant}: bench/ab.py)"
  trees=(); for t in ${AB_TREES:-}; do trees+=(--tree "$t"); done
  python3 -m bench.ab ${AB_VARIANTS:-} "${trees[@]}" ${AB_CMD:+--cmd "$AB_CMD"} --repeat ${AB_REPEAT:-2} \
    --timeout ${AB_TIMEOUT:-200} > "$OUT/ab.txt" 2>&1 || rc=1
  cat "$OUT/ab.txt"
fi
if has graphab; then
  # Our captured GPT-2 decode step, hot (bench/time_decode_graph.py), under the default tree and each GRAPH_AB
  # variant (bench/ab.py: same call, two interleaved rounds), then the default with FUSED_ATTN_PDL=0.
  log "graphab (${GRAPH_AB:-no variant})"
  python3 -m bench.ab ${GRAPH_AB:-} --cmd "python3 -m bench.time_decode_graph ${GRAPH_AB_ARGS:-}" --repeat 2 \
    --timeout 120 2>&1 | grep -v "^\[transformers\]" | tee -a "$OUT/graphab.txt" || rc=1
  python3 -m fused_attn.build 2>&1 | tail -1
  FUSED_ATTN_PDL=0 timeout 120 python3 -m bench.time_decode_graph --tag "PDL=0" ${GRAPH_AB_ARGS:-} 2>&1 \
    | grep -v "^\[transformers\]" | tee -a "$OUT/graphab.txt" || rc=1
fi
if has build; then
  log build
  /usr/bin/time -f "cold build wall %e s" python3 -m fused_attn.build 2>&1 | tail -3 | tee -a "$OUT/gpu.txt" || rc=1
  python3 -c "
import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import fused_attn; fused_attn.load(); t2 = time.perf_counter()
print(f'warm: import torch {t1 - t0:.2f} s, import fused_attn + load cached library {t2 - t1:.2f} s')" 2>&1 | tee -a "$OUT/gpu.txt"
fi
# pytest_side_by_side LOG LIMIT PROFILE MARK GROUP...: one pytest process per GROUP (a space-separated list of
# test files), all sharing the GPU, each with its own log; LOG joins them, and their summary lines and failures
# are printed. SIGINT at LIMIT: pytest stops as on Ctrl-C and still prints its summary and the failures so far
# (a plain kill loses the failures' tracebacks); -k 30: killed if it does not stop. The caller's
# environment (FUSED_ATTN_NVCC_FLAGS, say) reaches every process.
pytest_side_by_side() {
  local out=$1 limit=$2 profile=$3 mark=$4 group i n=0
  shift 4
  local pids=()
  # The processes share the machine's cores: each gets its share of torch's CPU threads (the CPU references).
  # Unbounded (16 a process on the 16-core H200 host), the tests step at the gpu profile had passed one of
  # test_sample.py's GPU tests after 323 s and was inside the second; alone, with 8 threads, its 69 GPU tests
  # took 25 s (2026-11-30). Whether the threads or the GPU's time slicing between the processes made the
  # difference was not measured.
  local threads=${OMP_NUM_THREADS:-$(( $(nproc) / $# > 0 ? $(nproc) / $# : 1 ))}
  for group in "$@"; do
    OMP_NUM_THREADS=$threads FUSED_ATTN_REQUIRE_GPU=1 HYPOTHESIS_PROFILE=$profile timeout -s INT -k 30 "$limit" \
      python3 -m pytest $group ${mark:+-m "$mark"} -q -p no:cacheprovider -rfEs --durations=5 \
      > "/tmp/side_by_side_$n.log" 2>&1 &
    pids+=($!)
    n=$((n + 1))
  done
  for pid in "${pids[@]}"; do wait $pid || rc=1; done
  for ((i = 0; i < n; i++)); do
    echo "=== group $i"; cat "/tmp/side_by_side_$i.log"; rm -f "/tmp/side_by_side_$i.log"
  done > "$out"
  grep -E "^=== group|passed|failed|error|KeyboardInterrupt" "$out" | grep -v "^E " | tail -12
  grep -E "^FAILED|Error" "$out" | head -20
}
if has tests; then
  # The suite no longer fits one serial run in a device call: TESTS_JOBS pytest processes share the GPU,
  # each on a group of test files (dealt largest first); tests.log joins their logs.
  # TESTS_FILES narrows the files (default: all of tests/test_*.py); TESTS_MARK the marker expression
  # (default "gpu": the CPU tests, which CI runs on every commit, took most of a device call; "" runs all).
  jobs=${TESTS_JOBS:-4}
  log "tests ($jobs processes)"
  files=$(ls -S ${TESTS_FILES:-tests/test_*.py})
  groups=()
  for j in $(seq 0 $((jobs - 1))); do
    group=$(echo $files | tr ' ' '\n' | awk -v j=$j -v n=$jobs 'NR % n == j')
    [ -n "$group" ] && groups+=("$(echo $group)")
  done
  pytest_side_by_side "$OUT/tests.log" ${TESTS_TIMEOUT:-300} ${HYPOTHESIS_PROFILE:-gpu} "${TESTS_MARK-gpu}" "${groups[@]}"
fi
if has pdl; then
  # The PDL-chained ops' GPU tests on copies of the tree with every launch triggering late, early, and only the
  # norms early (bench/ab.py's pdl-* variants), beside the default trigger points (common/pdl.cuh) that the
  # tests step runs.
  log "pdl (the trigger points)"
  FUSED_ATTN_REQUIRE_GPU=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} python3 -m bench.ab --no-default \
    pdl-early-none pdl-early-all pdl-norms-only-early --timeout ${PDL_TIMEOUT:-200} \
    --cmd "python3 -m pytest -q -p no:cacheprovider -rfE -m gpu $PDL_TEST_FILES" > "$OUT/pdl_tests.log" 2>&1 || rc=1
  tail -3 "$OUT/pdl_tests.log"
fi
if has flagtests; then
  log "flagtests (${FLAG_VARIANTS:-no variant})"
  FUSED_ATTN_REQUIRE_GPU=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} python3 -m bench.ab --no-default \
    ${FLAG_VARIANTS:-} --timeout ${FLAG_TIMEOUT:-300} --cmd "python3 -m pytest -q -p no:cacheprovider -rfE -m gpu \
    ${FLAG_TEST_FILES:-tests/test_linear.py tests/test_mlp.py tests/test_gpt2.py}" \
    > "$OUT/flag_tests.log" 2>&1 || rc=1
  tail -3 "$OUT/flag_tests.log"
fi
if has wide; then
  # Decode attention's GPU tests (and GPT-2's) on copies of the tree with every one-row launch on the wide build
  # and none (bench/ab.py's decode-wide-* variants), beside the default (decode_attention_heuristics.h) that the
  # tests step runs.
  log "wide (decode attention's 256-thread build)"
  FUSED_ATTN_REQUIRE_GPU=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} python3 -m bench.ab --no-default \
    decode-wide-every-batch decode-wide-off --timeout ${WIDE_TIMEOUT:-240} \
    --cmd "python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_decode_attention.py tests/test_gpt2.py" \
    > "$OUT/wide_tests.log" 2>&1 || rc=1
  tail -3 "$OUT/wide_tests.log"
fi
if has gpt2; then
  log "gpt2: GPU tests of the HF integration and our GPT-2, then backend comparisons"
  timeout ${GPT2_TESTS_TIMEOUT:-200} python3 -m pytest tests/test_hf.py tests/test_gpt2.py -q -p no:cacheprovider \
    -m gpu > "$OUT/gpt2_tests.log" 2>&1 || rc=1
  tail -3 "$OUT/gpt2_tests.log"
  for b in ${GPT2_BATCHES:-1 16}; do
    timeout ${GPT2_GEN_TIMEOUT:-150} python3 -m fused_attn.generate --compare --dtype float16 --batch-size $b \
      --prompt-len 128 --max-new-tokens 128 >> "$OUT/gen.txt" 2>&1
    echo "rc=$?" >> "$OUT/gen.txt"
  done
  grep -v "^\[transformers\]" "$OUT/gen.txt" | tail -20
fi
if has gpt2bench; then
  # One pytest run per batch size, each with its own JSON: a run killed by the time limit keeps the other.
  # Batches past 1 and 16 are not headline cases: on a GPU they need GPT2_BENCH_ARGS="--full --bench-gpt2-batches N"
  # (and GPT2_BENCH_K to narrow --full's dtypes and sampling).
  for b in ${GPT2_BENCH_BATCHES:-1 16}; do
    log "bench_gpt2 batch $b"
    k="b$b-"
    [ -n "${GPT2_BENCH_K:-}" ] && k="b$b- and ($GPT2_BENCH_K)"
    timeout ${GPT2_BENCH_TIMEOUT:-270} python3 -m pytest bench/bench_gpt2.py -v -p no:cacheprovider -k "$k" \
      --benchmark-json="$OUT/bench_gpt2_b$b.json" ${GPT2_BENCH_ARGS:-} >> "$OUT/bench_gpt2.log" 2>&1 || rc=1
    tail -2 "$OUT/bench_gpt2.log"
  done
  ls "$OUT"/bench_gpt2_b*.json > /dev/null 2>&1 && python3 -m bench.report "$OUT"/bench_gpt2_b*.json \
    --out /tmp/fused_attn_report_gpt2 --no-plots > /dev/null && grep -v "^#" /tmp/fused_attn_report_gpt2/gpt2.txt
fi
if has profile; then
  log "profile: ${PROFILE_ARGS:---backends hf-eager,graph}"
  timeout ${PROFILE_TIMEOUT:-200} python3 -m bench.profile ${PROFILE_ARGS:---backends hf-eager,graph} --out /tmp/profile \
    > "$OUT/profile.log" 2>&1 || rc=1
  tar czf "$OUT/profile.tgz" -C /tmp profile  # one file: at most 8 come back from a device call
  tail -4 "$OUT/profile.log"
fi
if has sanitize; then
  log sanitize
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool" >> "$OUT/sanitize.log"
    quick=$([ $tool = racecheck ] && echo --quick)
    timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 1 --print-limit 20 \
      python3 tests/sanitizer_cases.py $quick ${SANITIZE_ONLY:+--only $SANITIZE_ONLY} >> "$OUT/sanitize.log" 2>&1 || rc=1
    tail -2 "$OUT/sanitize.log"
  done
fi
if has bench; then
  log bench
  for i in $(seq 1 ${BENCH_REPEAT:-1}); do  # back-to-back runs measure the run-to-run spread
    json="$OUT/bench_softmax$([ $i = 1 ] || echo _$i).json"
    # forward (135 cases) + backward (66); ~60 compiles with a cold Inductor cache: ~3-4 min on an H100/H200
    timeout ${BENCH_TIMEOUT:-420} python3 -m pytest bench/bench_softmax.py -q -p no:cacheprovider \
      --benchmark-json="$json" --benchmark-columns=median,iqr,rounds ${BENCH_ARGS:-} \
      >> "$OUT/bench.log" 2>&1 || rc=1
  done
  tail -3 "$OUT/bench.log"
  [ -f "$OUT/bench_softmax.json" ] && python3 -m bench.report "$OUT/bench_softmax.json" \
    --out /tmp/fused_attn_report_softmax --no-plots > /dev/null && cat /tmp/fused_attn_report_softmax/micro.txt
fi
# One op's benchmark step: bench_step NAME TIMEOUT "ARGS" FILE... writes $OUT/bench_NAME.json and .log,
# prints the pass/fail line, the failures and bench.report's README table.
# BENCH_K (any step run through bench_step) and GPT2_BENCH_K: one -k expression, passed quoted (the
# *_ARGS variables are split on spaces, so an expression with spaces cannot go through them).
bench_step() {
  local name=$1 limit=$2 args=$3; shift 3
  local k=()
  [ -n "${BENCH_K:-}" ] && k=(-k "$BENCH_K")
  # -p no:logging: pytest's log capture would collect torch's DEBUG trace records of every compile.
  timeout "$limit" python3 -m pytest "$@" -q -rs -p no:cacheprovider -p no:logging "${k[@]}" \
    --benchmark-json="$OUT/bench_$name.json" --benchmark-columns=median,iqr,rounds $args \
    > "$OUT/bench_$name.log" 2>&1 || rc=1
  grep -E "passed|failed|error" "$OUT/bench_$name.log" | tail -1
  grep -E "^FAILED|^SKIPPED|Error" "$OUT/bench_$name.log" | head -20
  [ -f "$OUT/bench_$name.json" ] && python3 -m bench.report "$OUT/bench_$name.json" \
    --out "/tmp/fused_attn_report_$name" --no-plots > /dev/null && cat "/tmp/fused_attn_report_$name/readme.md"
}
if has decode; then
  log "decode (bench_decode_attention)"
  # 16 shapes x 7-8 providers + 46 serving shapes x 4-5 in float16 (362 cases), 16 compiles; K + V up to 34 GB per
  # case (B16 H32 L128k D128); a provider whose modeled peak memory does not fit is skipped
  bench_step decode "${DECODE_TIMEOUT:-420}" "${DECODE_ARGS:-}" bench/bench_decode_attention.py
fi
if has serving; then
  log "serving (bench_decode_attention: the serving bar's cases, eager and in CUDA graphs, float16 and bfloat16)"
  # SERVING_K and SERVING_GRAPH_K, 216 cases a run, 75-90 s each on an H200 (2026-11-30); bench.serving_bar reads
  # the four runs: ours against the better SDPA backend, paged against contiguous.
  for mode in eager graph; do
    name=SERVING_$([ $mode = graph ] && echo GRAPH_)K
    k=$(python3 -c "from bench import bench_decode_attention as b; print(b.$name)")
    for dt in float16 bfloat16; do
      timeout "${SERVING_TIMEOUT:-240}" python3 -m pytest bench/bench_decode_attention.py --full --bench-dtypes $dt \
        -q -rs -p no:cacheprovider -p no:logging -k "$k" --benchmark-json="$OUT/bench_serving_${mode}_$dt.json" \
        >> "$OUT/bench_serving.log" 2>&1 || rc=1
      grep -E "passed|failed|error" "$OUT/bench_serving.log" | tail -1
    done
  done
  python3 -m bench.serving_bar "$OUT"/bench_serving_*.json 2>&1 | tee -a "$OUT/bench_serving.log"
fi
if has norm; then
  log "norm (bench_layer_norm)"
  # 2 widths x 8 row counts x 2 norms x with/without residual x 3 providers in float16 (192 cases), 64 compiles;
  # then the embedding + layer_norm cases (6 row counts x 3 providers)
  bench_step layer_norm "${NORM_TIMEOUT:-420}" "${NORM_ARGS:-}" bench/bench_layer_norm.py
fi
if has attention; then
  log "attention (bench_attention)"
  # the flash kernel's two versions against SDPA first (~30 s; exits 1 on a wrong answer), then
  # 12 shapes x 2 causal x 8 providers in float16 (192 cases); the materializing providers skip S = 16384
  timeout 120 python3 -m dev.check_flash_wgmma > "$OUT/check_flash_wgmma.log" 2>&1 || rc=1
  cat "$OUT/check_flash_wgmma.log"
  bench_step attention "${ATTN_TIMEOUT:-420}" "${ATTN_ARGS:-}" bench/bench_attention.py
fi
if has linear; then
  log "linear (bench_linear, bench_mlp)"
  # 6 shapes x 7 M x 3 providers (126 cases) + layer_norm + linear 3 shapes x 3 M x 3 (27) + 2 models x 7 M x 3 (42)
  # in float16; one compile per compiled case
  bench_step linear "${LINEAR_TIMEOUT:-480}" "${LINEAR_ARGS:-}" bench/bench_linear.py bench/bench_mlp.py
fi
if has host; then
  log "host (bench_host)"
  # 8 ops x 2 providers, host clock: ~30 s
  bench_step host "${HOST_TIMEOUT:-120}" "${HOST_ARGS:-}" bench/bench_host.py
fi
if has sample; then
  log "sample (bench_sample)"
  # 6 shapes x 2 temperatures x 3 providers in float16 (36 cases), 12 compiles
  bench_step sample "${SAMPLE_TIMEOUT:-240}" "${SAMPLE_ARGS:-}" bench/bench_sample.py
fi
if has layer; then
  log "layer (bench_layer)"
  # 2 models x 4 sequences x 3 providers in float16 (24 cases); one compile per compiled case
  bench_step layer "${LAYER_TIMEOUT:-300}" "${LAYER_ARGS:-}" bench/bench_layer.py
fi
if has bytes; then
  log bytes
  timeout ${BYTES_TIMEOUT:-200} python3 -m bench.bytes > "$OUT/bytes.txt" 2>&1 || rc=1
  timeout ${BYTES_TIMEOUT:-200} python3 -m bench.bytes --backward >> "$OUT/bytes.txt" 2>&1 || rc=1
  tail -30 "$OUT/bytes.txt"
fi
kill $CLOCKS_PID 2>/dev/null; wait $CLOCKS_PID 2>/dev/null
python3 -m bench.clocks "$CLOCKS" 2>&1 | tee -a "$OUT/gpu.txt"
log "done rc=$rc"
exit $rc
