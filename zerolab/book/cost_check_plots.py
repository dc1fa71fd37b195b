"""The appendix's figures: the cost model's predictions beside the published figures, misses shown.

Every function takes the rows of `zerolab.book.cost_checks` (each a published figure, the model's one
prediction of it and a verdict against a margin fixed beforehand) and draws them; nothing is
computed here that the rows do not hold.

* `bus_figure(rows)`: nccl-tests bus bandwidths, published against the model, with the margin;
* `zeropp_figure(rows)`: every bar of the ZeRO++ blog's Figures 6 and 7 beside the model's
  prediction, its figure with nothing hidden, and the model's compute rate;
* `speedup_figure(rows)`: ZeRO++ over ZeRO-3, published against predicted, bar pair by bar pair;
* `errors_figure(rows)`: every checked row's error against its margin, hits and misses.
"""

from __future__ import annotations

from . import cost_checks

VERDICT_COLORS = {"hit": "#55A868", "miss": "#C44E52", "restates a calibration": "#999999",
                  "not modelled": "#8172B3"}
ENGINE_COLORS = {"ZeRO-3": "#4C72B0", "ZeRO++": "#DD8452"}


def _panels():
    """(cards per node, tokens per GPU) of the ZeRO++ figures, in the blog's order."""
    return list(cost_checks.ZEROPP_BARS)


def _bar(by: dict, label: str, nics: int, tokens: int, size: int):
    return by[f"{label}, {size}B, {nics} x 100 Gb/s per node, {tokens // 1024}K tokens per GPU"]


def bus_figure(rows):
    """One line per bus-bandwidth row: the published figure with its margin (grey band), the model's
    prediction (a diamond coloured by the verdict)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.55 * len(rows)))
    for y, r in enumerate(rows):
        lo, hi = r.published * (1 - r.margin), r.published * (1 + r.margin)
        ax.barh(y, hi - lo, left=lo, height=0.5, color="#dddddd")
        ax.plot([r.published] * 2, [y - 0.25, y + 0.25], "-", color="black", lw=1.5)
        ax.plot(r.predicted, y, "D", color=VERDICT_COLORS[r.verdict], ms=7)
        ax.text(max(hi, r.predicted) + 6, y, f"{r.verdict} ({100 * r.error:+.0f}%)", va="center", fontsize=8,
                color=VERDICT_COLORS[r.verdict])
    ax.set_yticks(range(len(rows)), [r.what for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(r.published * (1 + r.margin) for r in rows) * 1.35)
    ax.set_xlabel("all-reduce bus bandwidth (GB/s)")
    fig.suptitle("nccl-tests bus bandwidths: published (black tick; grey band: the ±10% margin) "
                 "and the model's prediction (diamond)", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def zeropp_figure(rows):
    """Four panels, one per panel of the blog's Figures 6 and 7: bars = published TFLOP/s per GPU of
    ZeRO-3 and ZeRO++ per model size; a black tick = the model's prediction, a hollow circle =
    the model with nothing hidden; dashed = the model's compute rate, the most it can predict."""
    import matplotlib.pyplot as plt

    by = {r.what: r for r in rows}
    sizes = cost_checks.ZEROPP_SIZES
    fig, axes = plt.subplots(2, 2, figsize=(9, 5.6), sharey=True)
    for ax, (nics, tokens) in zip(axes.flat, _panels()):
        for j, label in enumerate(("ZeRO-3", "ZeRO++")):
            for i, size in enumerate(sizes):
                r = _bar(by, label, nics, tokens, size)
                x = i + (j - 0.5) * 0.38
                ax.bar(x, r.published, width=0.36, color=ENGINE_COLORS[label],
                       edgecolor="black" if r.hit else VERDICT_COLORS["miss"], lw=0.5 if r.hit else 2,
                       label=label if i == 0 else None)
                ax.plot([x - 0.17, x + 0.17], [r.predicted] * 2, "-", color="black", lw=2,
                        label="model" if (i, j) == (0, 0) else None)
                ax.plot(x, r.nothing_hidden, "o", mfc="white", mec="black", ms=5,
                        label="model, nothing hidden" if (i, j) == (0, 0) else None)
        ceiling = _bar(by, "ZeRO-3", nics, tokens, sizes[0]).ceiling
        ax.axhline(ceiling, color="black", ls="--", lw=0.8)
        ax.set_xticks(range(len(sizes)), [f"{s}B" for s in sizes])
        ax.set_title(f"Figure {6 if nics == 4 else 7}: {nics} card{'s' if nics > 1 else ''} per node, "
                     f"{tokens:,} tokens per GPU", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("TFLOP/s per V100")
    for ax in axes[1]:
        ax.set_xlabel("model size (parameters)")
    axes[0][0].legend(fontsize=7.5, loc="upper right", ncol=2)
    fig.suptitle("ZeRO++ blog, 384 V100s: published bars (red edge: the model misses by more than 15%),\n"
                 "the model's prediction (black tick) and its compute rate (dashed)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def speedup_figure(rows):
    """ZeRO++ over ZeRO-3 for every bar pair: published (bar) and predicted (diamond), by panel."""
    import matplotlib.pyplot as plt

    by = {r.what: r for r in rows}
    sizes = cost_checks.ZEROPP_SIZES
    fig, ax = plt.subplots(figsize=(9, 3.2))
    x, ticks = 0, []
    for p, (nics, tokens) in enumerate(_panels()):
        for size in sizes:
            r = _bar(by, "ZeRO++ over ZeRO-3", nics, tokens, size)
            ax.bar(x, r.published, width=0.7, color="#cccccc", edgecolor="black", lw=0.5)
            ax.plot(x, r.predicted, "D", color=VERDICT_COLORS[r.verdict], ms=6)
            ticks.append((x, f"{size}B"))
            x += 1
        ax.text(x - 2.5, 2.75, f"{nics} card{'s' if nics > 1 else ''}, {tokens // 1024}K tokens", ha="center",
                fontsize=8)
        x += 0.8
    ax.axhline(1, color="black", lw=0.6)
    ax.set_xticks([t for t, _ in ticks], [s for _, s in ticks], fontsize=7.5)
    ax.set_ylim(0, 2.95)
    ax.set_ylabel("speed-up (x)")
    ax.set_title("ZeRO++ over ZeRO-3: published (bars) and the ratio of the model's two predictions\n"
                 "(diamond: green hit, red miss; margin ±15%)", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def errors_figure(rows):
    """Every row's error (model / published - 1) by kind of figure, the margin shaded: a point inside
    its band is a hit. Rows that restate a calibration or lack a mechanism are hollow."""
    import matplotlib.pyplot as plt

    kinds = list(cost_checks.MARGINS)
    fig, ax = plt.subplots(figsize=(8, 3.0))
    for y, kind in enumerate(kinds):
        m = 100 * cost_checks.MARGINS[kind]
        ax.fill_betweenx([y - 0.4, y + 0.4], -m, m, color="#e8f3ea", lw=0)
        these = [r for r in rows if r.kind == kind]
        for i, r in enumerate(these):
            jitter = 0.5 * ((i * 7) % 13 / 12 - 0.5)
            filled = r.role == "check"
            ax.plot(100 * r.error, y + jitter, "o", ms=6, color=VERDICT_COLORS[r.verdict],
                    mfc=VERDICT_COLORS[r.verdict] if filled else "white", alpha=0.85)
        t = cost_checks.tally(these)
        ax.text(1.01, y, f"{t['hit']} hit, {t['miss']} miss", transform=ax.get_yaxis_transform(), va="center",
                fontsize=8)
    ax.axvline(0, color="black", lw=0.6)
    ax.set_yticks(range(len(kinds)), [f"{k} (±{100 * cost_checks.MARGINS[k]:.0f}%)" for k in kinds], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("model / published - 1 (%)")
    ax.set_title("Every prediction against its margin (green band): green hit, red miss, hollow = not counted",
                 fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    return fig
