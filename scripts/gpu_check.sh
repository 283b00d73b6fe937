#!/usr/bin/env bash
# The whole GPU check in one call (run it on the GPU machine from the repository root):
#   scripts/gpu_check.sh [STAGE ...]     stages: machine tests refs bench ddtree kvpool demo sanitize
#                                        tune timeline ab spike ncu cudaverify
#                                        (default: all but sanitize, tune, timeline, ab, spike, ncu, cudaverify; BENCH_ARGS, DEMO_ARGS, DDTREE_ARGS, ...
#                                        pass options; TESTS: the test files or ids of stage tests (default: the
#                                        whole suite), TEST_SHARDS: its processes (default 12);
#                                        FLASHMLA_DIR adds FlashMLA to the bench: a folder with flashmla_peer.py)
# Results go to $OUT (default ./gpu_out): machine.txt, log.txt (every stage's output), tests.txt, JSON files,
# bench/ (JSON, CSV, PNG).
# Runs from the source tree (PYTHONPATH=src): nothing is installed.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(machine tests refs bench ddtree kvpool demo)
status=0
for stage in "${stages[@]}"; do
  echo "=== $stage ($(date -u +%H:%M:%S))" | tee -a "$OUT/log.txt"
  case "$stage" in
    machine)
      { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
        git rev-parse HEAD 2>/dev/null || echo "commit ${KDTREE_GIT_COMMIT:-unknown}"; } | tee "$OUT/machine.txt" ;;
    tests)  # most of the suite's time is compiling kernels (each parametrised case its own; one process took
      # > 600 s for the whole suite, test_ddtree_tree.py alone > 170 s): the cases of TESTS (default: all)
      # dealt round-robin to TEST_SHARDS processes, which compile side by side (run 35: 88 cases, 12
      # processes, ~55 s)
      shards=$(mktemp -d)
      python3 -m pytest -q --collect-only -p no:cacheprovider ${TESTS:-tests} | grep '::' > "$shards/ids" || status=1
      split -n r/${TEST_SHARDS:-12} -d "$shards/ids" "$shards/shard_"
      pids=()
      for f in "$shards"/shard_*; do
        [ -s "$f" ] || continue  # (no ids: pytest would run the whole suite)
        mapfile -t ids < "$f"
        python3 -m pytest -q -p no:cacheprovider "${ids[@]}" > "$f.log" 2>&1 & pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      echo "$(wc -l < "$shards/ids") cases in ${#pids[@]} processes" | tee -a "$OUT/log.txt"
      for f in "$shards"/shard_*.log; do grep -E "^(FAILED|ERROR)|passed|failed|error" "$f"; done | tee -a "$OUT/log.txt"
      cat "$shards"/shard_*.log > "$OUT/tests.txt" ;;  # (the failures' tracebacks)
    refs)
      refs=$(mktemp -d)
      python3 -m kdtree_engine.cli refs generate "$refs" --device cuda > /dev/null &&
      python3 -m kdtree_engine.cli refs generate "$refs" --large --device cuda > /dev/null &&
      python3 -m kdtree_engine.cli refs check --kernel all --device cuda "$refs"/*.kdtr 2>&1 | tee -a "$OUT/log.txt" || status=1 ;;
    bench)
      python3 -m kdtree_engine.bench.cli ${BENCH_ARGS:---quick} ${FLASHMLA_DIR:+--flashmla "$FLASHMLA_DIR"} --out-dir "$OUT/bench" 2>&1 | tee -a "$OUT/log.txt" | tail -60 || status=1 ;;
    ddtree)
      python3 -m kdtree_engine.ddtree.bench ${DDTREE_ARGS:---targets} --json "$OUT/ddtree.json" 2>&1 | tee -a "$OUT/log.txt" | tail -40 || status=1 ;;
    kvpool)
      python3 -m kdtree_engine.kvpool_bench ${KVPOOL_ARGS:-} --json "$OUT/kvpool.json" 2>&1 | tee -a "$OUT/log.txt" | tail -60 || status=1 ;;
    demo)
      python3 -m kdtree_engine.demo ${DEMO_ARGS:---quick} --json "$OUT/demo.json" 2>&1 | tee -a "$OUT/log.txt" | tail -60 || status=1 ;;
    sanitize)
      for tool in memcheck racecheck initcheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_flash.py 2>&1 \
          | grep -E "PASS|FAIL|ERROR SUMMARY|RACECHECK SUMMARY|Error" | tee -a "$OUT/log.txt" || status=1
      done ;;
    tune)
      python3 scripts/tune_flash.py ${TUNE_ARGS:-} --json "$OUT/tune.json" 2>&1 | tee -a "$OUT/log.txt" || status=1 ;;
    ab)  # AB_VARIANTS: whole verify/hopper.py files or FILE.diff:NAME sections to time against this tree's (scripts/ab_hopper.py)
      python3 scripts/ab_hopper.py ${AB_VARIANTS:?AB_VARIANTS names the variant hopper.py files} ${AB_ARGS:-} \
        --json "$OUT/ab.json" 2>&1 | tee -a "$OUT/log.txt" || status=1 ;;
    spike)  # the CUDA step spike (scripts/hopper_cuda_step.py): SPIKE_VARIANTS (NAME=FLAGS;...), SPIKE_ARGS (--shapes,
      # --page1, --sms, --stamps), FlashMLA beside it with FLASHMLA_DIR, JSON to spike$SPIKE_TAG.json; under a
      # timeout (SPIKE_TIMEOUT, 300 s): a build that never ran may hang
      timeout "${SPIKE_TIMEOUT:-300}" python3 scripts/hopper_cuda_step.py ${SPIKE_VARIANTS:+--variants "$SPIKE_VARIANTS"} \
        ${SPIKE_ARGS:-} ${FLASHMLA_DIR:+--flashmla "$FLASHMLA_DIR"} --json "$OUT/spike${SPIKE_TAG:-}.json" 2>&1 \
        | tee -a "$OUT/log.txt" || status=1 ;;
    ncu)  # Nsight Compute, one call of each main kernel at NCU_SHAPES (default 16x9x4x131072), every metric the
      # step comparisons read (scripts/ncu_kernels.py --metrics-list): FlashMLA's and ours (ncu_kernels.csv), then
      # with SPIKE_VARIANTS the spike's, its checks' launches skipped (ncu_spike.csv)
      metrics=$(python3 scripts/ncu_kernels.py --metrics-list)
      ncu --clock-control none --csv --metrics "$metrics" -k regex:"flash_fwd_splitkv_mla_kernel|_hopper_verify_kernel" \
        python3 scripts/ncu_kernels.py "${NCU_SHAPES:-16x9x4x131072}" ${FLASHMLA_DIR:+--flashmla "$FLASHMLA_DIR"} \
        > "$OUT/ncu_kernels.csv" 2>> "$OUT/log.txt" || status=1
      if [ -n "${SPIKE_VARIANTS:-}" ]; then
        n=$(( $(tr -cd ';' <<< "$SPIKE_VARIANTS" | wc -c) + 1 ))  # variants: 3 check launches each, then 2 timed
        timeout "${SPIKE_TIMEOUT:-300}" ncu --clock-control none --csv --metrics "$metrics" -k regex:step_kernel \
          --launch-skip $((3 * n)) --launch-count $((2 * n)) python3 scripts/hopper_cuda_step.py \
          --shapes "${NCU_SHAPES:-16x9x4x131072}" --variants "$SPIKE_VARIANTS" --rounds 1 --iters 1 \
          > "$OUT/ncu_spike.csv" 2>> "$OUT/log.txt" || status=1
      fi
      tail -n +1 "$OUT"/ncu_*.csv | grep -E "gpc__cycles_elapsed.max|sm__pipe_tensor" | tee -a "$OUT/log.txt" ;;
    cudaverify)  # the CUDA C++ kernel (kernel="hopper_cuda", scripts/hopper_cuda_verify.py), first run in
      # run 46: its check against the float64 reference (CUDA_CASES random batches, default 40; the default build,
      # the cp.async producer alone and each build of CUDA_BUILDS, ';'-separated nvcc flags), the sanitizers
      # CUDA_TOOLS (default memcheck synccheck) on 3 small ones of each build of CUDA_SANITIZE_BUILDS (default: the
      # default build), then with CUDA_AB_SHAPES an A/B of both beside
      # the Gluon kernel (ab_hopper.py cuda + CUDA_AB_VARIANTS, default cuda:-DKD_TMA=0;
      # cudaverify_ab.json); under timeouts (CUDA_TIMEOUT 150 s, CUDA_AB_TIMEOUT 300 s): a build that never ran may hang
      IFS=';' read -ra builds <<< "${CUDA_BUILDS:-}"
      for flags in "" "-DKD_TMA=0" "${builds[@]}"; do  # TMA for pairs of whole tiles (the default), the cp.async producer alone
        echo "--- build '$flags'" | tee -a "$OUT/log.txt"
        timeout "${CUDA_TIMEOUT:-150}" python3 scripts/hopper_cuda_verify.py --cases "${CUDA_CASES:-40}" --flags="$flags" \
          2>&1 | tee -a "$OUT/log.txt" | grep -vE "^PASS" || status=1
      done
      IFS=';' read -ra sanitize_builds <<< "${CUDA_SANITIZE_BUILDS:-}"
      [ ${#sanitize_builds[@]} -eq 0 ] && sanitize_builds=("")
      for flags in "${sanitize_builds[@]}"; do
        for tool in ${CUDA_TOOLS:-memcheck synccheck}; do
          echo "--- $tool, build '$flags'" | tee -a "$OUT/log.txt"
          timeout "${CUDA_TIMEOUT:-150}" compute-sanitizer --tool $tool --error-exitcode 9 \
            python3 scripts/hopper_cuda_verify.py --cases 3 --small --flags="$flags" 2>&1 \
            | grep -E "PASS|FAIL|ERROR SUMMARY|Error" | tee -a "$OUT/log.txt" || status=1
        done
      done
      if [ -n "${CUDA_AB_SHAPES:-}" ]; then
        timeout "${CUDA_AB_TIMEOUT:-300}" python3 scripts/ab_hopper.py cuda ${CUDA_AB_VARIANTS-cuda:-DKD_TMA=0} \
          --shapes "$CUDA_AB_SHAPES" \
          --rounds "${AB_ROUNDS:-3}" --json "$OUT/cudaverify_ab.json" 2>&1 | tee -a "$OUT/log.txt" || status=1
      fi ;;
    timeline)
      python3 scripts/hopper_timeline.py ${TIMELINE_ARGS:-} --json "$OUT/timeline.json" 2>&1 | tee -a "$OUT/log.txt" || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
echo "=== gpu_check exit $status"
exit $status
