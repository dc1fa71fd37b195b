"""The CUDA caching allocator during a ZeRO-3 step, beside chapter 9's allocator model.

    python -m gpu.memsnap OUTDIR

World 1 on NCCL, the ~406 M GPT of gpu.bench in bf16 with activation checkpointing (chapter 9's
setting: checkpoints and gradients are the long-lived blocks M_D moves). Two steps are recorded
with torch.cuda.memory._record_memory_history; the snapshot gives the allocator's segments and
its alloc/free timeline: reserved - allocated is the real fragmentation (plus caching). A third
step is followed op by op (zerolab.memory.AllocationTracker) and replayed in
zerolab.theory.allocator (the model chapter 9 uses) without and with M_D.
"""

from __future__ import annotations

import os
import sys

import torch

import zerolab as zl
from gpu.common import write_json
from gpu.workers.memsnap import memsnap_worker


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = res["cuda"]
    tl = c["timeline"]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    xs = range(len(tl))
    ax.plot(xs, [a / 2 ** 30 for a, _ in tl], lw=1, label="allocated (change since recording began)")
    ax.plot(xs, [r / 2 ** 30 for _, r in tl], lw=1, label="segments reserved (change)")
    ax.set_xlabel("allocator event (sampled)")
    ax.set_ylabel("GiB")
    m = res["machine"]
    ax.set_title(f"ZeRO-3 bf16, 2 steps: CUDA caching allocator ({m['device']}, {m['date']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(outdir):
    os.makedirs(outdir, exist_ok=True)
    cuda = torch.cuda.is_available()
    # the raw snapshot stays on the machine (it can be large); open it at pytorch.org/memory_viz
    snap = "/tmp/zero3_memory_snapshot.pickle" if cuda else None
    r = zl.launch(memsnap_worker, 1, timeout=500, args=("350m" if cuda else "cpu-test", 8 if cuda else 2, snap))[0]
    result = {"what": "CUDA caching allocator during ZeRO-3 bf16 steps (activation checkpointing on), "
                      "beside zerolab.theory.allocator's model of the same step", **r}
    if cuda:
        c = r["cuda"]
        c["fragmentation_peak_bytes"] = c["reserved_peak"] - c["allocated_peak"]
        c["fragmentation_peak_fraction"] = c["fragmentation_peak_bytes"] / c["reserved_peak"]
        print(f"CUDA: allocated peak {c['allocated_peak'] / 2**30:.2f} GiB, reserved peak "
              f"{c['reserved_peak'] / 2**30:.2f} GiB, reserved - allocated {c['fragmentation_peak_bytes'] / 2**30:.2f} "
              f"GiB ({100 * c['fragmentation_peak_fraction']:.1f}%); at the end {c['segments_end']} segments, "
              f"{c['free_in_segments_end'] / 2**30:.2f} GiB free in {c['free_blocks_end']} blocks, largest "
              f"{c['largest_free_block_end'] / 2**20:.0f} MiB; retries {c['num_alloc_retries']}")
    m = r["model"]
    print(f"model: peak live {m['without_MD']['peak_live'] / 2**30:.2f} GiB, reserved {m['without_MD']['reserved'] / 2**30:.2f} "
          f"GiB (frag {100 * m['without_MD']['fragmentation']:.1f}%); with M_D reserved "
          f"{m['with_MD']['reserved'] / 2**30:.2f} GiB (frag {100 * m['with_MD']['fragmentation']:.1f}%)")
    write_json(os.path.join(outdir, "memory_snapshot.json"), result)
    if cuda:
        import json
        with open(os.path.join(outdir, "memory_snapshot.json")) as f:
            plot(json.load(f), os.path.join(outdir, "memory_snapshot.png"))
    return result


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
