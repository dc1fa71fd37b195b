"""Figures for chapter 14: what each rank holds of one transformer block, flat units beside FSDP2."""

from __future__ import annotations

import matplotlib.pyplot as plt


def _colors(names):
    cmap = plt.get_cmap("tab20")
    return {name: cmap(i % 20) for i, name in enumerate(names)}


def layouts(flat: dict, rows: dict, shapes: dict, n: int):
    """Two panels from a real run. Top: the block's flat buffer (zl.ZeRO(stage=3): `flat` =
    {"shard": elements per rank, "params": [(name, offset, size)]}), each rank's contiguous slice.
    Bottom: FSDP2's shards of the same parameters (`rows`: rows of each parameter on a rank;
    `shapes`: their full shapes): every rank holds ceil(d0 / N) rows of every parameter."""
    names = [name for name, _, _ in flat["params"]]
    color = _colors(names)
    total = flat["shard"] * n
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True)
    for name, o, k in flat["params"]:
        for r in range(n):
            lo, hi = max(o, r * flat["shard"]), min(o + k, (r + 1) * flat["shard"])
            if lo < hi:
                top.barh(r, hi - lo, left=lo, color=color[name], edgecolor="white", linewidth=0.3)
    for r in range(1, n):
        top.axvline(r * flat["shard"], color="black", linewidth=1)
    top.set_title("flat unit (ZeRO-3): rank r holds one contiguous 1/N of the block's buffer")
    for r in range(n):                       # FSDP2: the same flat order, each parameter's rows split
        at = 0
        for name in names:
            shape = shapes[f"blocks.0.{name}"]
            numel = 1
            for d in shape:
                numel *= d
            per_rank = rows[name] * (numel // shape[0])
            bottom.barh(r, per_rank * n, left=at, color=color[name], alpha=0.25, edgecolor="none")
            bottom.barh(r, per_rank, left=at + r * per_rank, color=color[name], edgecolor="white", linewidth=0.3)
            at += per_rank * n
    bottom.set_title("per-parameter shards (FSDP2): rank r holds rows r/N of every parameter (pale: others')")
    for ax in (top, bottom):
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
        ax.invert_yaxis()
    bottom.set_xlabel(f"elements of one block ({total:,} with padding)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[name]) for name in names]
    fig.legend(handles, names, loc="center right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    return fig
