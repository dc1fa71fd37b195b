"""The bench figure from the committed results (no GPU needed): python -m gpu.plots gpu/results

The figure is zerolab.book.bench_plots.gpu_bench_figure, the one chapter 10 draws; this writes it as
results/bench.png for the README and the book's other readers of the committed results."""

from __future__ import annotations

import json
import os
import sys


def plot_bench(results_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from zerolab.book.bench_plots import gpu_bench_figure
    reps = [json.load(open(os.path.join(results_dir, f))) for f in ("bench.json", "bench_rep2.json")
            if os.path.exists(os.path.join(results_dir, f))]
    fig = gpu_bench_figure(reps)
    path = os.path.join(results_dir, "bench.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(plot_bench(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")))
