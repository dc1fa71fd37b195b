"""DDP's overlap and ZeRO-3's prefetch on CUDA tensors, measured by zerolab's ledger.

    python -m gpu.overlap OUTDIR

Chapter 5's naive / bucketed / overlapped DDP and chapter 8's prefetch=0 vs 1, with the models
on the GPU in bf16. World 2 runs two ranks on the one GPU over gloo (CUDA tensors, staged
through the host: communication is slow and really happens, so there is something to hide);
world 1 runs NCCL, where a collective has nothing to move. Times are host-clock, after a
torch.cuda.synchronize() at each step's end; "overlap" is the share of the gradient
communication's time that ran before the backward's compute ended (zerolab.book.timeline).
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

import zerolab as zl
from gpu.common import write_json
from gpu.workers.overlap import ddp_overlap_worker, prefetch_worker


def main(outdir):
    os.makedirs(outdir, exist_ok=True)
    cuda = torch.cuda.is_available()
    cfg, batch = ("124m", 4) if cuda else ("cpu-test", 2)
    result = {"what": "DDP overlap and ZeRO-3 prefetch on CUDA tensors (bf16), from zerolab's ledger",
              "model": f"gpu.workers.bench_cfg({cfg!r})", "batch_per_rank": batch, "ddp": {}, "prefetch": {}}
    for n, backend in ((2, "gloo"), (1, None)):
        key = f"world{n}"
        try:
            ranks = zl.launch(ddp_overlap_worker, n, backend=backend, timeout=400, args=(cfg, batch))
            rows = {m: {"step_ms": max(r["rows"][m]["step_s"] for r in ranks) * 1e3,
                        "allreduce_calls": ranks[0]["rows"][m]["calls"],
                        "overlap": min(r["rows"][m]["overlap"] for r in ranks),
                        "wait_after_backward_ms": max(r["rows"][m]["wait_after_backward_s"] for r in ranks) * 1e3}
                    for m in ranks[0]["rows"]}
            result["ddp"][key] = {"backend": ranks[0]["backend"], "device": ranks[0]["device"], "rows": rows}
            for m, r in rows.items():
                print(f"{key} DDP {m:10s} step {r['step_ms']:7.1f} ms, {r['allreduce_calls']:3d} all-reduces, "
                      f"{100 * r['overlap']:3.0f}% hidden, wait after backward {r['wait_after_backward_ms']:6.1f} ms")
        except Exception as e:  # noqa: BLE001
            result["ddp"][key] = {"error": f"{type(e).__name__}: {str(e)[-800:]}"}
            print(f"{key} DDP FAILED {str(e)[-400:]}")
        try:
            ranks = zl.launch(prefetch_worker, n, backend=backend, timeout=400, args=(cfg, batch))
            steps = len(ranks[0]["times"][0])
            t = {pf: [max(r["times"][pf][i] for r in ranks) for i in range(steps)] for pf in (0, 1)}
            w = {pf: [max(r["waits"][pf][i] for r in ranks) for i in range(steps)] for pf in (0, 1)}
            entry = {"backend": ranks[0]["backend"], "device": ranks[0]["device"], "steps": steps,
                     "step_ms": {str(pf): statistics.median(t[pf]) * 1e3 for pf in (0, 1)},
                     "gather_wait_ms": {str(pf): statistics.median(w[pf]) * 1e3 for pf in (0, 1)},
                     "median_ratio_pf1_over_pf0": statistics.median(a / b for a, b in zip(t[1], t[0]))}
            result["prefetch"][key] = entry
            print(f"{key} ZeRO-3 prefetch=0 {entry['step_ms']['0']:.1f} ms (blocked {entry['gather_wait_ms']['0']:.1f}), "
                  f"prefetch=1 {entry['step_ms']['1']:.1f} ms (blocked {entry['gather_wait_ms']['1']:.1f}), "
                  f"ratio {entry['median_ratio_pf1_over_pf0']:.3f}")
        except Exception as e:  # noqa: BLE001
            result["prefetch"][key] = {"error": f"{type(e).__name__}: {str(e)[-800:]}"}
            print(f"{key} prefetch FAILED {str(e)[-400:]}")
    write_json(os.path.join(outdir, "overlap.json"), result)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
