"""Figures (and one widget) for chapters 1 and 2. Every number drawn is computed here or
passed in from a real run; nothing is typed in by hand."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyBboxPatch

from ..theory import numerics as N

COLORS = {"fp32": "tab:blue", "fp16": "tab:red", "bf16": "tab:green", "e4m3": "tab:purple",
          "e5m2": "tab:orange", "naive fp16": "tab:gray"}
FIELD_COLORS = {"sign": "#f4a6a6", "exponent": "#a6c8f4", "mantissa": "#b8e6b0"}


# ------------------------------------------------------------------ chapter 1


def draw_bits(ax, value: float, fmt: str, y: float = 0.0):
    """One row of boxes: the bits of `value` rounded to `fmt`, coloured by field."""
    f = N.get_format(fmt)
    b = N.decompose(value, f)
    bits = format(N.to_bits(value, f), f"0{f.bits}b")
    for i, ch in enumerate(bits):
        field = "sign" if i == 0 else ("exponent" if i <= f.exponent_bits else "mantissa")
        ax.add_patch(plt.Rectangle((i, y), 0.95, 0.8, color=FIELD_COLORS[field]))
        ax.text(i + 0.47, y + 0.4, ch, ha="center", va="center", fontsize=8, family="monospace")
    ax.text(-0.5, y + 0.4, f"{f.name}", ha="right", va="center", fontsize=9)
    ax.text(f.bits + 0.5, y + 0.4, f"= {b.value:.10g}  ({b.kind})", ha="left", va="center", fontsize=9)


def plot_bits(value: float, formats=N.NAMES):
    """The same number stored in every format, one row each."""
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(formats) + 0.8))
    for row, fmt in enumerate(formats):
        draw_bits(ax, value, fmt, y=len(formats) - 1 - row)
    for field, c in FIELD_COLORS.items():
        ax.plot([], [], "s", color=c, label=field, markersize=10)
    ax.legend(loc="upper right", bbox_to_anchor=(1.0, 1.25), ncol=3, frameon=False, fontsize=9)
    ax.set_xlim(-4, 50)
    ax.set_ylim(-0.3, len(formats))
    ax.axis("off")
    ax.set_title(f"{value!r} stored in each format", loc="left", fontsize=10)
    return fig


def plot_spacing(formats=N.NAMES, zoom=(1e-9, 1e6)):
    """Spacing (ulp) against magnitude for every format, on one log-log figure (right: zoomed
    to the magnitudes where weights, gradients and the 8- and 16-bit formats live)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax in axes:
        _spacing_axes(ax, formats)
    axes[1].set_xlim(*zoom)
    axes[1].set_ylim(1e-12, 1e4)
    axes[1].set_title("zoomed in", fontsize=10)
    fig.tight_layout()
    return fig


def _spacing_axes(ax, formats):
    for fmt in formats:
        lo, hi = N.smallest_subnormal(fmt), N.largest(fmt)
        xs = np.logspace(math.log10(lo), math.log10(hi), 2000)
        ys = [N.ulp(float(x), fmt) for x in xs]
        ax.loglog(xs, ys, color=COLORS[fmt], label=f"{fmt} (eps {N.eps(fmt):.1e})", lw=1.5)
        ax.plot([N.smallest_normal(fmt)], [N.ulp(N.smallest_normal(fmt), fmt)], "o", color=COLORS[fmt], ms=4)
    ax.axvline(1.0, color="k", lw=0.5, ls=":")
    ax.axhline(1e-5, color="k", lw=0.5, ls="--")
    ax.text(1.5, 1.5e-5, "update 1e-5", fontsize=8)
    ax.set_xlabel("magnitude |x|")
    ax.set_ylabel("spacing to the next value (ulp)")
    ax.set_title("Spacing grows with magnitude; flat at the left = subnormals (dots: smallest normal)",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)


def plot_range(formats=N.NAMES):
    """Each format's representable magnitudes as a bar: subnormal part lighter."""
    fig, ax = plt.subplots(figsize=(8, 2.8))
    for i, fmt in enumerate(formats):
        sub, nor, big = (math.log10(N.smallest_subnormal(fmt)), math.log10(N.smallest_normal(fmt)),
                         math.log10(N.largest(fmt)))
        ax.barh(i, nor - sub, left=sub, color=COLORS[fmt], alpha=0.35)
        ax.barh(i, big - nor, left=nor, color=COLORS[fmt])
        ax.text(big + 1, i, f"{N.dynamic_range(fmt):.0f} decades", va="center", fontsize=8)
    ax.set_yticks(range(len(formats)), formats)
    ax.set_xlabel("log10 |x|  (light: subnormal)")
    ax.set_xlim(-48, 50)
    ax.axvline(0, color="k", lw=0.5)
    ax.set_title("Dynamic range", fontsize=10)
    return fig


def plot_gradient_underflow(grad_abs, scales=(1.0, 2.0**8, 2.0**16)):
    """Histogram of log2 |gradient| with fp16's limits, before and after loss scaling."""
    g = np.asarray(grad_abs, dtype=np.float64)
    g = g[g > 0]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bins = np.arange(-45, 20, 1.0)
    for s, alpha in zip(scales, (0.8, 0.5, 0.35)):
        ax.hist(np.log2(g * s), bins=bins, alpha=alpha, label=f"gradients x {s:g}")
    for x, name, side in ((math.log2(N.smallest_subnormal("fp16")) - 1, "rounds to 0 at or below", -1),
                          (math.log2(N.smallest_subnormal("fp16")), "fp16 smallest subnormal", 1),
                          (math.log2(N.smallest_normal("fp16")), "fp16 smallest normal", 1),
                          (math.log2(N.largest("fp16")), "fp16 largest", 1)):
        ax.axvline(x, color="k", ls="--", lw=0.8)
        ax.text(x + 0.3 * side, ax.get_ylim()[1] * 0.9, name, rotation=90, va="top",
                ha="left" if side > 0 else "right", fontsize=7)
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("elements")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("Loss scaling shifts the gradient histogram into fp16's range", fontsize=10)
    return fig


def plot_stochastic_rounding(nearest, means, samples, delta: float, fmt: str = "fp16"):
    """A weight at 1.0 receiving the same small update every step, stored in `fmt`: the
    nearest-rounded weight (flat), a few stochastically rounded weights (each a random walk
    between neighbours), their mean over all weights, and the exact sum. Arguments are the
    per-step values the chapter's run recorded."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    steps = np.arange(1, len(nearest) + 1)
    for i, path in enumerate(samples):
        ax.plot(steps, path, color=COLORS["bf16"], lw=0.6, alpha=0.5,
                label="one weight, stochastic rounding" if i == 0 else None)
    ax.plot(steps, means, color=COLORS["bf16"], lw=2, label="mean of all weights, stochastic")
    ax.plot(steps, 1 + delta * steps, "k--", lw=1, label="exact: 1 + steps x update")
    ax.plot(steps, nearest, color=COLORS["fp16"], lw=2, label="round to nearest")
    ax.set_xlabel("update step")
    ax.set_ylabel(f"weight stored in {fmt}")
    ax.set_title(f"Adding {delta:g} per step in {fmt}: nearest rounding never moves, "
                 "stochastic rounding is right on average", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def running_sum(value: float, n: int, fmt: str) -> list:
    """The left-to-right running total of n copies of `value`, stored in `fmt` after every
    addition: N.sum_naive's arithmetic, every partial sum kept."""
    term, total, out = N.round_to(value, fmt), 0.0, []
    for _ in range(n):
        total = N.round_to(total + term, fmt)
        out.append(total)
    assert out[-1] == N.sum_naive([value] * n, fmt)
    return out


def plot_running_sum(value: float = 0.1, n: int = 4096, fmt: str = "fp16"):
    """The running total of n copies of `value` in `fmt` against the exact running total: each
    addition rounds to the spacing at the total, so the sum drifts and then stops where half
    the spacing exceeds the term."""
    naive = running_sum(value, n, fmt)
    term = N.round_to(value, fmt)
    ks = np.arange(1, n + 1)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.plot(ks, ks * term, "k--", lw=1, label="exact running sum")
    ax.plot(ks, naive, color=COLORS[fmt], lw=2, label=f"running sum stored in {fmt}")
    stop = naive[-1]
    first = naive.index(stop) + 1
    ax.axhline(stop, color=COLORS[fmt], lw=0.6, ls=":")
    ax.annotate(f"stuck at {stop:g}: spacing {N.ulp(stop, fmt):g} there,\nhalf of it is more than {value:g}",
                (first, stop), (first + 0.05 * n, stop * 0.55), fontsize=8,
                arrowprops=dict(arrowstyle="->", lw=0.8))
    ax.set_xlabel("values added")
    ax.set_ylabel("running sum")
    ax.set_title(f"Adding {value:g} {n} times, rounding to {fmt} after every addition", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ chapter 2


def plot_protocol():
    """The canonical mixed-precision protocol as a data-flow figure."""
    fig, ax = plt.subplots(figsize=(10, 4.2))
    ax.axis("off")
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 4.4)
    ax.add_patch(plt.Rectangle((0.1, 2.35), 9.8, 1.95, color="#fdebd0", zorder=0))
    ax.add_patch(plt.Rectangle((0.1, 0.1), 9.8, 1.95, color="#d6eaf8", zorder=0))
    ax.text(0.2, 4.1, "low precision (fp16 / bf16): 2 + 2 bytes per parameter", fontsize=9, weight="bold")
    ax.text(0.2, 0.25, "fp32: 4 + 4 + 4 bytes per parameter (the paper's K = 12)", fontsize=9, weight="bold")

    def box(x, y, text, w=1.9):
        ax.add_patch(FancyBboxPatch((x, y), w, 0.8, boxstyle="round,pad=0.05", fc="white", ec="k"))
        ax.text(x + w / 2, y + 0.4, text, ha="center", va="center", fontsize=8.5)

    def arrow(x0, y0, x1, y1, text=""):
        ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="->", lw=1.3))
        if text and y0 == y1:  # horizontal: label centred below the arrow
            ax.text((x0 + x1) / 2, y0 - 0.25, text, fontsize=8, color="darkred", ha="center", va="top")
        elif text:
            ax.text(x0 + 0.08, (y0 + y1) / 2, text, fontsize=8, color="darkred", va="center")

    box(0.4, 3.0, "θ16 params")
    box(3.2, 3.0, "forward\n(x * scale for fp16 loss)", w=2.3)
    box(6.6, 3.0, "g16 = ∇ loss\n(backward)")
    box(6.6, 0.9, "g32 /= scale\ninf/nan? skip")
    box(3.2, 0.9, "Adam on θ32\nm32, v32", w=2.3)
    box(0.4, 0.9, "θ32 master")
    arrow(2.3, 3.4, 3.2, 3.4, "1 forward")
    arrow(5.5, 3.4, 6.6, 3.4, "2 backward")
    arrow(7.55, 3.0, 7.55, 1.7, "3 cast to fp32")
    arrow(6.6, 1.3, 5.5, 1.3, "4 unscale, check")
    arrow(3.2, 1.3, 2.3, 1.3, "5 update")
    arrow(1.35, 1.7, 1.35, 3.0, "6 refresh: cast to 16 bits")
    return fig


def plot_four_ways(runs: dict, smooth_k: int = 10):
    """Loss of the four runs on one figure, and the fp16 loss scale with skipped steps."""
    from .mixed_precision_demo import smooth

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    styles = {"fp32": "-", "naive fp16": "-", "fp16": "--", "bf16": ":"}
    for kind, r in runs.items():
        ax.plot(smooth(r["loss"], smooth_k), styles[kind], color=COLORS[kind], lw=1.8,
                label=f"{kind}: final {np.mean(r['loss'][-smooth_k:]):.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({smooth_k}-step mean)")
    ax.set_title("Same initial weights, same batches, four precisions", fontsize=10)
    ax.legend(fontsize=8)
    r = runs["fp16"]
    bx.semilogy(r["scale"], color=COLORS["fp16"], drawstyle="steps-post", label="loss scale")
    skipped = [i for i, a in enumerate(r["applied"]) if not a]
    bx.plot(skipped, [r["scale"][i] for i in skipped], "kx", label=f"skipped steps ({len(skipped)})")
    bx.set_xlabel("step")
    bx.set_title("fp16: dynamic loss scale (after each step)", fontsize=10)
    bx.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_scale_trajectory(scales, applied, title):
    fig, ax = plt.subplots(figsize=(6, 2.8))
    ax.semilogy(scales, drawstyle="steps-post")
    bad = [i for i, a in enumerate(applied) if not a]
    ax.plot(bad, [scales[i] for i in bad], "kx", ms=4, label="skipped")
    ax.set_xlabel("step")
    ax.set_ylabel("scale after the step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_lost_updates(lrs, lost):
    fig, ax = plt.subplots(figsize=(5.5, 3))
    ax.semilogx(lrs, [100 * x for x in lost], "o-", color=COLORS["naive fp16"])
    ax.set_xlabel("learning rate")
    ax.set_ylabel("% of updates lost")
    ax.set_title("Naive fp16: updates that rounding erased", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_small_lr(runs: dict, smooth_k: int = 20):
    """Left: how far each run's loss has come down since its first steps; right: the share of
    the weights the forward pass uses that have moved at all since step 0."""
    from .mixed_precision_demo import smooth

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    styles = {"fp32": "-", "naive fp16": "-", "fp16": "--"}
    labels = {"fp32": "fp32", "naive fp16": "naive fp16 (no master copy)", "fp16": "fp16 + fp32 master weights"}
    for kind, r in runs.items():
        curve = smooth(r["loss"], smooth_k)
        start = curve[smooth_k - 1]
        ax.plot(range(smooth_k - 1, len(curve)), [start - c for c in curve[smooth_k - 1:]], styles[kind],
                color=COLORS[kind], lw=1.8, label=labels[kind])
        bx.plot([100 * m for m in r["moved"]], styles[kind], color=COLORS[kind], lw=1.8, label=labels[kind])
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss decrease ({smooth_k}-step mean)")
    ax.set_title("Progress since the first steps", fontsize=10)
    ax.legend(fontsize=8)
    bx.set_xlabel("step")
    bx.set_ylabel("% of weights changed since step 0")
    bx.set_ylim(0, 105)
    bx.set_title("Weights the forward pass sees that have moved", fontsize=10)
    bx.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_scaler_rules(pattern, trajectories: dict):
    """log2 of the scale after each step, one line per scaler, overflowing steps marked."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    styles = ["-", "--", "-.", ":"]
    for (name, scales), style in zip(trajectories.items(), styles):
        ax.plot([math.log2(s) for s in scales], style, drawstyle="steps-post", lw=1.8, label=name)
    top = max(math.log2(s) for scales in trajectories.values() for s in scales)
    bad = [i for i, o in enumerate(pattern) if o]
    ax.plot(bad, [top + 0.5] * len(bad), "kx", label="overflowing step")
    ax.set_xlabel("step")
    ax.set_ylabel("log2(scale) after the step")
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("One pattern of overflows, four scaling rules", fontsize=10)
    fig.tight_layout()
    return fig


def plot_bytes_per_param(rows: dict):
    """Measured bytes per parameter of model states in each precision (stacked by kind), with
    what the step allocates on top of them at its peak (hatched): `rows` is
    mixed_precision_demo.memory_per_param's result per precision."""
    kinds = [("params", "tab:blue"), ("grads", "tab:orange"), ("master", "tab:purple"),
             ("moments+counters", "tab:green")]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for x, (precision, r) in enumerate(rows.items()):
        bottom = 0.0
        for kind, color in kinds:
            ax.bar(x, r[kind], bottom=bottom, color=color, width=0.6, edgecolor="white",
                   label=kind if x == 0 else None)
            if r[kind] > 0:
                ax.text(x, bottom + r[kind] / 2, f"{r[kind]:.0f}", ha="center", va="center", fontsize=8,
                        color="white")
            bottom += r[kind]
        ax.bar(x, r["step increment"], bottom=bottom, width=0.6, fill=False, hatch="//", edgecolor="gray",
               label="allocated inside step()" if x == 0 else None)
        ax.text(x, bottom + r["step increment"] + 0.3, f"peak {r['peak during step']:.1f}", ha="center",
                fontsize=8)
    ax.axhline(16, color="k", ls="--", lw=0.8, label="the paper's 16 bytes")
    ax.set_xticks(range(len(rows)), list(rows))
    ax.set_xlabel("training precision")
    ax.set_ylabel("bytes per parameter")
    ax.set_ylim(0, 25)
    ax.set_title("AdamW model states, measured: 16 bytes per parameter in every precision", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def plot_stalled_update(paths: dict, lr: float):
    """One weight pushed down by `lr` every step: kept in fp16 it never moves; the fp32 master
    moves steadily, and its fp16 copy (what the forward pass uses) follows it in steps of one
    fp16 spacing. `paths` is mixed_precision_demo.stalled_update_paths's result."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    styles = {"fp16 weight": ("tab:red", "-", 2.0), "fp32 master": ("black", "--", 1.0),
              "fp16 of master": ("tab:green", "-", 1.5)}
    for key in ("fp16 weight", "fp16 of master", "fp32 master"):     # the master drawn on top
        path = paths[key]
        color, style, lw = styles[key]
        ax.plot(range(1, len(path) + 1), path, style, color=color, lw=lw, label=key,
                drawstyle="steps-post" if key.startswith("fp16") else "default")
    ax.set_xlabel("update step")
    ax.set_ylabel("weight value")
    ax.set_title(f"Updates of {lr:g} on a weight at 1.0: lost in fp16, kept by the fp32 master", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
