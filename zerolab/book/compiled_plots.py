"""Figures for chapter 16: the step as a graph, ZeRO's passes over it, memory, and time."""

from __future__ import annotations

import matplotlib.pyplot as plt

COLORS = {"input": "#8c8c8c", "forward": "#4c72b0", "backward": "#dd8452", "view": "#d9d9d9",
          "all-gather": "#55a868", "reduce-scatter": "#c44e52", "free": "#000000"}
LANES = ("input", "forward", "view", "backward")


def graph(drawn: dict):
    """Every node of a small captured step in program order, one lane per kind, with its edges."""
    kinds, labels = drawn["kinds"], drawn["labels"]
    y = [LANES.index(k) for k in kinds]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for i, j in drawn["edges"]:
        ax.annotate("", (j, y[j]), (i, y[i]), arrowprops={"arrowstyle": "-|>", "color": "#999999", "lw": 0.6,
                                                           "connectionstyle": "arc3,rad=0.15"})
    ax.scatter(range(len(kinds)), y, s=60, c=[COLORS[k] for k in kinds], zorder=3, edgecolors="black", linewidths=0.4)
    for i, label in enumerate(labels):
        ax.text(i, y[i] + 0.18, label, rotation=45, fontsize=7, ha="left", va="bottom")
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_ylim(-0.5, len(LANES) + 0.9)
    ax.set_xlabel("position in the program (node index)")
    ax.set_title("A two-layer perceptron's training step as captured by make_fx")
    fig.tight_layout()
    return fig


def passes(stages: dict):
    """One row per stage of ZeRO-3's passes: each node a thin bar coloured by its kind."""
    fig, ax = plt.subplots(figsize=(10, 3.2))
    for row, (label, seen) in enumerate(stages.items()):
        kinds = seen["kinds"]
        ax.bar(range(len(kinds)), 0.8, bottom=row - 0.4, width=1.0, color=[COLORS[k] for k in kinds], linewidth=0)
    ax.set_yticks(range(len(stages)), list(stages))
    ax.invert_yaxis()
    ax.set_xlabel("position in the program (node index)")
    ax.set_title("The GPT's step after each pass (ZeRO-3, N = 4)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), ncol=7, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    fig.tight_layout()
    return fig


def memory(timelines: dict):
    """Bytes alive after each allocation: the liveness pass's prediction (lines) and the tracker's
    measurement (dots), one panel per prefetch depth."""
    fig, axes = plt.subplots(1, len(timelines), figsize=(10, 3.0), sharey=True)
    for ax, (label, (predicted, measured)) in zip(axes, timelines.items()):
        ax.plot(range(len(predicted)), [b / 1024 for b in predicted], color="#4c72b0", lw=1.2, label="predicted")
        ax.plot(range(len(measured)), [b / 1024 for b in measured], ".", color="#dd8452", ms=2.5, label="measured")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("allocation number")
    axes[0].set_ylabel("KiB alive on rank 0")
    axes[0].legend(fontsize=8)
    fig.suptitle("Memory during one ZeRO-3 step (N = 2): the graph's prediction and the measurement")
    fig.tight_layout()
    return fig


def step_times(rows: dict, baseline: str):
    """Median seconds per step relative to `baseline`, with the spread (min to max) of the ratio."""
    labels = list(rows)
    base = sorted(rows[baseline])[len(rows[baseline]) // 2]
    med = [sorted(v)[len(v) // 2] / base for v in rows.values()]
    lo = [m - min(v) / base for m, v in zip(med, rows.values())]
    hi = [max(v) / base - m for m, v in zip(med, rows.values())]
    fig, ax = plt.subplots(figsize=(8, 3.0))
    ax.barh(labels, med, xerr=[lo, hi], color="#4c72b0", capsize=3)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds per step / median of '{baseline}' (bars: median, whiskers: min to max)")
    ax.set_title("ZeRO-3 step time on 4 gloo ranks sharing 2 CPU cores")
    fig.tight_layout()
    return fig
