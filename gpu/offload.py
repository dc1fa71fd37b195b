"""ZeRO-R's activation options on the GPU: checkpointing, P_a, and P_a+cpu (offload over PCIe).

    python -m gpu.offload OUTDIR

World 1 on NCCL: the ~406 M GPT of gpu.bench in bf16 under zl.ZeRO(stage=2), 8 sequences a
step, with and without activation checkpointing (P_a needs a model-parallel group). World 2
on gloo (two ranks on the one GPU, CUDA tensors): the ~163 M GPT split by tensor parallelism
(Mesh dp=1, mp=2), all four options; P_a+cpu sends each rank's checkpoint slices to pinned
host memory and back over PCIe, beside the card's measured pinned copy rates.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

import zerolab as zl
from gpu.common import write_json
from gpu.workers.offload import offload_worker


def main(outdir):
    os.makedirs(outdir, exist_ok=True)
    cuda = torch.cuda.is_available()
    result = {"what": "ZeRO-R activation options under zl.ZeRO(stage=2), bf16: step time, peak allocated, "
                      "bytes offloaded per step; pinned host<->device copy rates",
              "runs": {}}
    for n, backend, cfg, batch in ((1, None, "350m", 8), (2, "gloo", "124m", 8)):
        cfg = cfg if cuda else "cpu-test"
        batch = batch if cuda else 2
        try:
            ranks = zl.launch(offload_worker, n, backend=backend, timeout=400, args=(cfg, batch))
        except Exception as e:  # noqa: BLE001
            result["runs"][f"world{n}"] = {"error": f"{type(e).__name__}: {str(e)[-1200:]}"}
            print(f"world {n}: FAILED {str(e)[-600:]}")
            continue
        r = ranks[0]
        entry = {"world_size": n, "backend": r["backend"], "device": r["device"], "model": cfg,
                 "batch_per_rank": batch, "mesh": None if n == 1 else f"dp=1, mp={n} (TensorParallelGPT)",
                 "pcie": r["pcie"], "rows": {}}
        if r["pcie"]:
            result["pcie"] = r["pcie"]
            print(f"pinned copies: host->device {r['pcie']['host_to_device'] / 1e9:.1f} GB/s, "
                  f"device->host {r['pcie']['device_to_host'] / 1e9:.1f} GB/s")
        for name in r["rows"]:
            rows = [x["rows"][name] for x in ranks]
            if not all(x["ok"] for x in rows):
                entry["rows"][name] = {"ok": False, "error": next(x["error"] for x in rows if not x["ok"])}
                print(f"world {n} {name:20s} FAILED {entry['rows'][name]['error']}")
                continue
            steps = [max(x["times"][i] for x in rows) * 1e3 for i in range(len(rows[0]["times"]))]   # slowest rank
            row = {"ok": True, "step_ms": statistics.median(steps), "step_ms_min": min(steps),
                   "step_ms_max": max(steps), "times_ms": steps,
                   "peak_bytes_per_rank": None if rows[0]["peak"] is None else max(x["peak"] for x in rows),
                   "offloaded_bytes_per_step_per_rank": max(x["offloaded_bytes_per_step"] for x in rows)}
            entry["rows"][name] = row
            peak = "n/a" if row["peak_bytes_per_rank"] is None else f"{row['peak_bytes_per_rank'] / 1e9:.2f} GB"
            print(f"world {n} {name:20s} step {row['step_ms']:7.1f} ms ({row['step_ms_min']:.0f}-"
                  f"{row['step_ms_max']:.0f})  peak/rank {peak}  offloaded "
                  f"{row['offloaded_bytes_per_step_per_rank'] / 1e6:.2f} MB/step/rank")
        result["runs"][f"world{n}"] = entry
    write_json(os.path.join(outdir, "offload.json"), result)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
