"""Figures for chapter 8, drawn from real ZeRO3 event traces and ledger records (and, for the last
one, from the cost model)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from . import zero3_trace

COLORS = {"gathering": "#f2c14e", "gathered": "#9ecae1", "in_use": "#3182bd"}
LABELS = {"gathering": "all-gather in flight", "gathered": "gathered, waiting", "in_use": "in use"}
PHASE_COLORS = {"forward all-gather": "#f2c14e", "backward all-gather": "#b8860b",
                "reduce-scatter": "#d62728", "other": "#8C8C8C", "all-reduce": "#C44E52"}
TIME_LABEL = "time since the step began (ms)"


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


def _backward_start(events):
    """Time of the first backward event (the boundary between the passes), or None."""
    return next((t for t, *_, phase in events if phase == "backward"), None)


def lifecycle(events, t0=0.0, ax=None, title="the life of each unit's parameters, rank 0"):
    """One row per unit: yellow = all-gather in flight, light = gathered, dark = in use, no bar =
    released (only the shard is held); red triangles = reduce-scatters. Time in ms."""
    units = list(dict.fromkeys(e[2] for e in events))
    ax = ax or plt.subplots(figsize=(9, 1.3 + 0.45 * len(units)))[1]
    for row, unit in enumerate(units):
        for a, b, state in _intervals(events, unit):
            ax.barh(row, (b - a) * 1e3, left=(a - t0) * 1e3, color=COLORS[state], height=0.6)
        for t, _, u, state, _ in events:
            if u == unit and state == "reduce_scatter":
                ax.plot((t - t0) * 1e3, row, "v", color="#d62728")
    tb = _backward_start(events)
    if tb is not None:
        ax.axvline((tb - t0) * 1e3, color="black", lw=0.8, ls=":")
        ax.text((tb - t0) * 1e3, -0.6, " backward ->", fontsize=8, va="bottom")
        ax.text((tb - t0) * 1e3, -0.6, "<- forward ", fontsize=8, va="bottom", ha="right")
    ax.set_yticks(range(len(units)), units)
    ax.set_ylim(len(units) - 0.5, -0.9)
    ax.set_ylabel("unit")
    ax.set_xlabel(TIME_LABEL)
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles + [plt.Line2D([], [], marker="v", ls="", color="#d62728")],
              [LABELS[s] for s in COLORS] + ["reduce-scatter issued"],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.figure.tight_layout()
    return ax


def timeline(runs, titles, suptitle="all-gathers, compute and reduce-scatters of one step, rank 0"):
    """Per setting, three lanes on one clock (ms): the all-gathers in flight, the units in use
    (compute) and the reduce-scatters in flight. runs: [(events, records, t0)]."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 0.6 + 1.75 * len(runs)), sharex=True)
    axes = list(axes) if len(runs) > 1 else [axes]
    for ax, (events, records, t0), title in zip(axes, runs, titles):
        for op, tag, a, b, _ in records:
            if op in ("all_gather", "reduce_scatter") and b is not None:
                row = 0 if op == "all_gather" else 2
                ax.barh(row, (b - a) * 1e3, left=(a - t0) * 1e3, height=0.6,
                        color="#f2c14e" if row == 0 else "#d62728", edgecolor="black", linewidth=0.3)
        for unit in dict.fromkeys(e[2] for e in events):
            for a, b, state in _intervals(events, unit):
                if state == "in_use":
                    ax.barh(1, (b - a) * 1e3, left=(a - t0) * 1e3, height=0.6, color="#3182bd",
                            edgecolor="white", linewidth=0.5)
        ax.set_yticks([0, 1, 2], ["all-gather", "compute\n(a unit in use)", "reduce-scatter"], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(TIME_LABEL, fontsize=8)
        ax.tick_params(labelbottom=True)
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    return fig


def gathered_bytes(runs: dict, unit_bytes: dict, full_bytes: int,
                   title="gathered parameters rank 0 holds during one step, beside its shard"):
    """Bytes of gathered (full) unit buffers over one step, per setting (zero3_trace.gathered_bytes),
    against the whole model. runs = {label: (events, t0)}. Time in ms, bytes in KiB."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, (label, (events, t0)) in enumerate(runs.items()):
        trace = zero3_trace.gathered_bytes(events, unit_bytes)
        xs = [0.0] + [(t - t0) * 1e3 for t, _ in trace]
        ys = [0] + [b for _, b in trace]
        ax.step(xs, [y / 2**10 for y in ys], where="post", lw=1.6, color=["#8172B3", "#3182bd"][i % 2],
                label=label)
    ax.axhline(full_bytes / 2**10, color="black", ls=":", lw=1, label="the whole model, fp32")
    ax.set_ylim(0, 1.1 * full_bytes / 2**10)
    ax.set_xlabel(TIME_LABEL)
    ax.set_ylabel("gathered parameters held\n(KiB, beyond the shard)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def sent_by_phase(rows: dict, title="bytes one rank sends per step, by collective"):
    """Stacked bars: rows = {label: {part: bytes}} in units already divided by the caller's unit
    (so that 1 means one all-gather of the whole model)."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for x, (label, parts) in enumerate(rows.items()):
        bottom = 0.0
        for part, h in parts.items():
            if h <= 0:
                continue
            ax.bar(x, h, bottom=bottom, width=0.55, color=PHASE_COLORS.get(part, "#8C8C8C"),
                   edgecolor="white", label=part if part not in ax.get_legend_handles_labels()[1] else None)
            if h > 0.2:
                ax.text(x, bottom + h / 2, f"{h:.2f}", ha="center", va="center", fontsize=8)
            bottom += h
    ax.set_xticks(range(len(rows)), list(rows), fontsize=8)
    ax.set_ylabel("bytes sent, in units of\n(N-1)/N x the model's bytes")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def exposed_vs_tokens(curves: dict, title="communication a step cannot hide (cost model)"):
    """Exposed milliseconds against tokens per GPU: curves = {label: (tokens, exposed_ms)}."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    styles = ["-", "--"]
    colors = ["#3182bd", "#d62728", "#55A868", "#8172B3"]
    for i, (label, (tokens, ms)) in enumerate(curves.items()):
        ax.plot(tokens, ms, styles[i % 2], color=colors[(i // 2) % 4], lw=1.6, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per GPU per step")
    ax.set_ylabel("exposed communication\nper step (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig
