"""Pictures and numbers from measurements: who holds what, and when communication happens.

* `comm_intervals(records, tag_prefix)`: the [start, end] of each recorded collective;
* `overlap_fraction(intervals, compute_end)`: the share of communication time that ran while
  backward was still computing (hidden), as opposed to after it (exposed, the job waits);
* `plot_timeline(rows)`: one lane per rank, compute bars and communication bars;
* `plot_holdings(states, titles)`: the values each rank holds, as a grid of coloured cells.
"""

from __future__ import annotations


def comm_intervals(records, tag_prefix: str = "") -> list:
    """[(start, end, tag)] for the finished records whose tag starts with tag_prefix."""
    return [(r.start, r.end, r.tag) for r in records
            if r.end is not None and r.tag.startswith(tag_prefix) and r.op not in ("barrier",)]


def _union(intervals):
    """Merge overlapping (start, end) intervals."""
    merged = []
    for s, e in sorted((s, e) for s, e, *_ in intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def overlap_fraction(intervals, compute_end: float) -> float:
    """Fraction of the communication time (union of intervals) that ran before compute_end."""
    merged = _union(intervals)
    total = sum(e - s for s, e in merged)
    if total <= 0:
        return 0.0
    hidden = sum(max(0.0, min(e, compute_end) - s) for s, e in merged)
    return hidden / total


def plot_timeline(rows, ax=None, title=None):
    """rows: one dict per rank {"compute": [(start, end, label)], "comm": [(start, end, label)]}.

    Times are seconds on each rank's own clock; every lane starts at that rank's first event
    (the ranks start a step together, after a barrier), and bars are drawn in milliseconds.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.9 + 0.8 * len(rows)))
    colors = {"forward": "#4C72B0", "backward": "#55A868", "step": "#8172B2", "comm": "#DD8452"}
    for r, row in enumerate(rows):
        # each rank has its own clock: align every lane on that rank's first event
        t0 = min(s for kind in ("compute", "comm") for s, *_ in row[kind])
        for s, e, label in row["compute"]:
            ax.barh(r + 0.18, (e - s) * 1e3, left=(s - t0) * 1e3, height=0.34,
                    color=colors.get(label, "#999999"))
        for s, e, label in row["comm"]:
            ax.barh(r - 0.18, max((e - s) * 1e3, 0.05), left=(s - t0) * 1e3, height=0.34,
                    color=colors["comm"], edgecolor="black", linewidth=0.4)
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["forward", "backward", "optimizer step", "all-reduce (one bar per bucket)"],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.2), ncol=4,
              fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    return ax


def plot_holdings(states, titles, ax_row=None, fmt="{:g}"):
    """states: list (one per panel) of lists (one per rank) of 1-D value lists.

    Draws one panel per state: a grid with a row per rank and a column per element, the
    value written in each cell. Empty cells (None) are drawn blank.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    n_panels = len(states)
    if ax_row is None:
        fig, ax_row = plt.subplots(1, n_panels, figsize=(2.6 * n_panels, 0.5 + 0.45 * len(states[0])))
        if n_panels == 1:
            ax_row = [ax_row]
    values = [v for ranks in states for vals in ranks for v in vals if v is not None]
    lo, hi = min(values), max(values)   # one colour scale for every panel
    for ax, ranks, title in zip(ax_row, states, titles):
        width = max(len(v) for v in ranks)
        grid = np.full((len(ranks), width), np.nan)
        for r, vals in enumerate(ranks):
            for j, v in enumerate(vals):
                if v is not None:
                    grid[r, j] = v
        ax.imshow(grid, cmap="YlGnBu", vmin=lo - 0.1 * (hi - lo), vmax=hi + 0.3 * (hi - lo), aspect="auto")
        for r in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if not np.isnan(grid[r, j]):
                    dark = grid[r, j] > lo + 0.55 * (hi - lo)
                    ax.text(j, r, fmt.format(grid[r, j]), ha="center", va="center", fontsize=8,
                            color="white" if dark else "black")
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))], fontsize=8)
        ax.set_xticks([])
        ax.set_title(title, fontsize=9)
    return ax_row
