"""Figures for chapter 8, drawn from real ZeRO3 event traces and ledger records."""

from __future__ import annotations

import matplotlib.pyplot as plt

COLORS = {"gathering": "#f2c14e", "gathered": "#9ecae1", "in_use": "#3182bd"}


def _intervals(events, unit):
    """[(start, end, state)] for one unit: gathering -> gathered -> in_use -> released."""
    out, cur, t_cur = [], None, None
    for t, _, u, state, _ in events:
        if u != unit or state == "reduce_scatter":
            continue
        if cur is not None:
            out.append((t_cur, t, cur))
        cur, t_cur = (None, None) if state == "released" else (state, t)
    return out


def lifecycle(events, t0=0.0, ax=None, title="parameter lifecycle, rank 0"):
    """One row per unit: yellow = all-gather in flight, light = gathered, dark = in use."""
    units = list(dict.fromkeys(e[2] for e in events))
    ax = ax or plt.subplots(figsize=(9, 0.5 + 0.45 * len(units)))[1]
    for row, unit in enumerate(units):
        for a, b, state in _intervals(events, unit):
            ax.barh(row, (b - a) * 1e3, left=(a - t0) * 1e3, color=COLORS[state], height=0.6)
        for t, _, u, state, _ in events:
            if u == unit and state == "reduce_scatter":
                ax.plot((t - t0) * 1e3, row, "v", color="#d62728")
    ax.set_yticks(range(len(units)), units)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began (released = no bar: only the shard is held)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles + [plt.Line2D([], [], marker="v", ls="", color="#d62728")],
              list(COLORS) + ["reduce-scatter"], loc="lower right", fontsize=8)
    return ax


def timeline(runs, titles):
    """Per rank and setting: all-gathers, compute (in use) and reduce-scatters on one clock."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.6 * len(runs)), sharex=True)
    for ax, (events, records, t0), title in zip(axes, runs, titles):
        for op, tag, a, b, _ in records:
            if op in ("all_gather", "reduce_scatter") and b is not None:
                row = 0 if op == "all_gather" else 2
                ax.barh(row, (b - a) * 1e3, left=(a - t0) * 1e3, height=0.6,
                        color="#f2c14e" if row == 0 else "#d62728")
        units = dict.fromkeys(e[2] for e in events)
        for unit in units:
            for a, b, state in _intervals(events, unit):
                if state == "in_use":
                    ax.barh(1, (b - a) * 1e3, left=(a - t0) * 1e3, height=0.6, color="#3182bd")
        ax.set_yticks([0, 1, 2], ["all-gather", "compute", "reduce-scatter"])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
    axes[-1].set_xlabel("ms since the step began")
    fig.tight_layout()
    return fig
