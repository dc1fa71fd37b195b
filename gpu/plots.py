"""The bench figure from the committed results (no GPU needed): python -m gpu.plots gpu/results"""

from __future__ import annotations

import json
import os
import sys


def plot_bench(results_dir):
    from zerolab.book import gpu_results as gr
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    reps = [json.load(open(os.path.join(results_dir, f))) for f in ("bench.json", "bench_rep2.json")
            if os.path.exists(os.path.join(results_dir, f))]
    m = reps[0]["machine"]
    w1 = [[r for r in rep["runs"]["world1"]["rows"] if r["ran"]] for rep in reps]
    names = [r["engine"] for r in w1[0]]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12, 4.6), dpi=90)
    width = 0.8 / len(reps)
    for i, rows in enumerate(w1):
        by = {r["engine"]: r for r in rows}
        a.barh([j + i * width for j in range(len(names))], [gr.mfu(by[n], reps[i]) * 100 for n in names], height=width,
               label=f"repetition {i + 1}")
    a.set_yticks([j + width * (len(reps) - 1) / 2 for j in range(len(names))], names, fontsize=7)
    a.invert_yaxis()
    a.set_xlabel("MFU (%): model FLOPs/s over the datasheet's 989 TFLOP/s", fontsize=8)
    a.set_title(f"world 1 (NCCL), {w1[0][0]['psi'] / 1e6:.0f} M-parameter GPT, bf16", fontsize=8)
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    rows = w1[0]
    mem = gr.world1_memory(reps[0])      # measured, or re-derived where the level moved (hatched)
    hatch = ["//" if mem[r["engine"]][2] else "" for r in rows]
    b.barh(range(len(rows)), [mem[r["engine"]][1] / 1e9 for r in rows], color="tab:blue", hatch=hatch,
           label="peak allocated")
    b.barh(range(len(rows)), [mem[r["engine"]][0] / 1e9 for r in rows], color="tab:green", hatch=hatch,
           label="held (hatched: re-derived)")
    b.scatter([r["formula_model_state_bytes"] / 1e9 for r in rows], range(len(rows)), color="k", marker="|", s=200,
              label="formula (model states)", zorder=3)
    b.set_yticks(range(len(rows)), [r["engine"] for r in rows], fontsize=7)
    b.invert_yaxis()
    b.set_xlabel("GB on the GPU, world 1", fontsize=8)
    b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    w2 = [r for r in reps[0]["runs"]["world2"]["rows"] if r["ran"]]
    c.barh(range(len(w2)), [r["peak_bytes"] / 1e9 for r in w2], color="tab:blue", label="peak allocated / rank")
    c.barh(range(len(w2)), [r["held_bytes"] / 1e9 for r in w2], color="tab:green", label="held / rank")
    c.scatter([r["formula_model_state_bytes"] / 1e9 for r in w2], range(len(w2)), color="k", marker="|", s=200,
              label="formula / rank", zorder=3)
    c.set_yticks(range(len(w2)), [r["engine"] for r in w2], fontsize=7)
    c.invert_yaxis()
    c.set_xlabel(f"GB per rank, world 2 (gloo), {w2[0]['psi'] / 1e6:.0f} M GPT", fontsize=8)
    c.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    for ax in (a, b, c):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"Measured on a GPU: {m['device']}, {m['date']}, torch {m['torch']}, CUDA {m['cuda']}", fontsize=9)
    fig.tight_layout()
    path = os.path.join(results_dir, "bench.png")
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(plot_bench(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")))
