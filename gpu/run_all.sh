#!/usr/bin/env bash
# The GPU track: every measurement committed under gpu/, from one script.
#
#   bash gpu/run_all.sh measure  OUTDIR   # versions, parity, bench, memory snapshot, profiler, offload, overlap (~9 min on an H100)
#   bash gpu/run_all.sh chapters OUTDIR   # every chapter executed, and the library tests (~8 min, CPU-heavy)
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
*) echo "usage: bash gpu/run_all.sh measure|chapters OUTDIR"; exit 2 ;;
esac
