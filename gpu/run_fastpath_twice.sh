#!/usr/bin/env bash
# The fast-path table twice in one machine start, like for like: eager rows (zerolab, PyTorch DDP,
# FSDP2, and DeepSpeed with its FusedAdam, built here by its op builder) then compiled rows, each
# phase run twice in a row. A deadline keeps the whole inside the device call's limit: a phase that
# would not finish before it is cut by `timeout` (its rows so far are kept: gpu.fastpath appends
# each row as it finishes).
#     bash gpu/run_fastpath_twice.sh OUTDIR [SECONDS]        (default 500 s in all)
# Wheels for what the GPU image lacks (DeepSpeed and its pure-Python dependencies, IPython for the
# chapters) may be carried in .whl/; they are installed into /tmp/site, not into the image.
set -u
out=${1:?OUTDIR}; budget=${2:-500}; t0=$(date +%s); mkdir -p "$out"
left() { echo $(( budget - ($(date +%s) - t0) )); }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$out/pip.log" 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
# DeepSpeed's op builder reads the architectures from here (the image's own value did not parse)
export DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST_FOR_DS:-9.0}
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)" > "$out/versions.txt" 2>&1
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" >> "$out/versions.txt" 2>&1
for phase in eager compiled; do
  for rep in 1 2; do
    l=$(left); [ "$l" -lt 30 ] && { echo "skipped $phase rep$rep: $l s left" | tee -a "$out/skipped.txt"; continue; }
    echo "== $phase rep$rep ($l s left)"
    timeout "$l" python3 -m gpu.fastpath "$out/${phase}_rep$rep" "$phase" > "$out/${phase}_rep$rep.log" 2>&1
    echo "rc=$? after $(( $(date +%s) - t0 )) s"; tail -12 "$out/${phase}_rep$rep.log"
  done
done
