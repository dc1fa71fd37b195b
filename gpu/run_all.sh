#!/usr/bin/env bash
# The GPU track: every measurement committed under gpu/, from one script.
#
#   bash gpu/run_all.sh measure  OUTDIR   # versions, parity, bench, memory snapshot, profiler, offload, overlap (~9 min on an H100)
#   bash gpu/run_all.sh chapters OUTDIR   # every chapter executed, and the library tests (~8 min, CPU-heavy)
#   bash gpu/run_all.sh fastpath OUTDIR   # each side's fast path (eager, compiled), offload on CUDA, and
#                                         # chapters 11-13 + the library tests on the other cores (~9 min)
#   bash gpu/run_all.sh rerun    OUTDIR   # the second start (~4 min): offload after its fixes, DeepSpeed's
#                                         # fused eager rows, chapters 11-13, the tests (names as they finish)
#
# Run from the repository root with the machine's own CUDA PyTorch (python3, or PYTHON=...).
# Chapters need IPython (and ipywidgets); the bench uses DeepSpeed when it imports.
set -u
PY=${PYTHON:-python3}
OUT=${2:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MPLBACKEND=Agg
case "${1:-}" in
measure)
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  $PY -c "import json,sys; from gpu.common import machine; json.dump(machine(), sys.stdout, indent=1)"; echo
  echo "== parity";   timeout 200 $PY -m gpu.parity "$OUT/parity.json"
  echo "== bench";    timeout 330 $PY -m gpu.bench "$OUT"
  echo "== memory";   timeout 150 $PY -m gpu.memsnap "$OUT"
  echo "== profiler"; timeout 150 $PY -m gpu.profile_steps "$OUT"
  echo "== offload";  timeout 200 $PY -m gpu.offload "$OUT"
  echo "== overlap";  timeout 200 $PY -m gpu.overlap "$OUT"
  ;;
chapters)
  # the library tests in the background (xdist when present), the chapters five at a time
  ( timeout 500 $PY -m pytest tests -v -p no:cacheprovider --timeout 300 \
      $($PY -c "import xdist" 2>/dev/null && echo "-n 4") > "$OUT/pytest.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest.log" ) &
  ls chapters/*.ipynb | xargs -P 5 -I{} sh -c 'n=$(basename {} .ipynb); timeout 480 '"$PY"' -m gpu.run_chapter {} '"$OUT"'/chapter_$n.json > '"$OUT"'/chapter_$n.log 2>&1 || echo "$n exit $?" >> '"$OUT"'/chapter_$n.log'
  cat "$OUT"/chapter_*.log | grep -E "^[0-9]+_.*(ok|FAILED) in|exit" || true
  wait
  tail -15 "$OUT/pytest.log"
  ;;
fastpath|rerun)
  export TORCH_CUDA_ARCH_LIST=9.0   # DeepSpeed 0.19.8's op builder cannot parse an arch list with "9.0a"
  # cores 0-7 drive the GPU; on cores 8-15 DeepSpeed's ops build first (its rows wait for them),
  # then chapters 11-13 and the library tests run beside the GPU rows
  end=$(( $(date +%s) + ${DEADLINE_S:-540} ))
  left() { echo $(( end - $(date +%s) )); }
  pin() { if command -v taskset > /dev/null; then taskset -c "$@"; else shift; "$@"; fi; }
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  ( pin 8-15 $PY -c "from deepspeed.ops.op_builder import FusedAdamBuilder, CPUAdamBuilder
for b in (FusedAdamBuilder, CPUAdamBuilder):
    try: b().load(); print(b.__name__, 'built')
    except Exception as e: print(b.__name__, 'NOT built:', type(e).__name__, e)" > "$OUT/deepspeed_ops.log" 2>&1 ) &
  [ "$1" = fastpath ] && { echo "== fast paths, eager"; pin 0-7 timeout 200 $PY -m gpu.fastpath "$OUT" eager; }
  ( for c in 11_your_own_model 12_zeropp_and_hierarchy 13_offload; do
      pin 8-15 timeout $(( $(left) - 20 )) $PY -m gpu.run_chapter chapters/$c.ipynb "$OUT/chapter_$c.json" > "$OUT/chapter_$c.log" 2>&1 &
    done
    pin 8-15 timeout $(( $(left) - 20 )) $PY -m pytest tests -v -p no:cacheprovider --timeout 240 -n 4 \
      > "$OUT/pytest.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest.log"; wait ) &
  cpu=$!
  if [ "$1" = fastpath ]; then
    echo "== offload on CUDA"; pin 0-7 timeout 170 $PY -m gpu.offload_cuda "$OUT"
    echo "== fast paths, compiled"; pin 0-7 timeout $(( $(left) > 60 ? $(left) - 15 : 45 )) $PY -m gpu.fastpath "$OUT" compiled
  else
    echo "== offload on CUDA, second run"; pin 0-7 timeout 150 $PY -m gpu.offload_cuda "$OUT" --second
    echo "== DeepSpeed, fused, eager"; pin 0-7 timeout $(( $(left) > 40 ? $(left) - 10 : 30 )) $PY -m gpu.fastpath "$OUT" eager --only DeepSpeed
  fi
  wait $cpu
  cat "$OUT"/chapter_*.log | grep -E "(ok|FAILED) in" || true
  grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.log" | tail -30
  ;;
*) echo "usage: bash gpu/run_all.sh measure|chapters|fastpath|rerun OUTDIR"; exit 2 ;;
esac
