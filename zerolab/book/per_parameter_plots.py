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


def persistence(kept: dict, n: int):
    """DeepSpeed's persistence threshold, measured (`per_parameter_demo.persistence`, rank 0):
    all-gathers per step and the bytes of parameters held at the end of backward, per threshold."""
    thresholds = [t for t in kept if isinstance(t, int)]
    labels = [f"{t:,}" for t in thresholds]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.0))
    gathers = [kept[t]["collectives"] for t in thresholds]
    held = [kept[t]["params_held"] / 1e6 for t in thresholds]
    left.bar(labels, gathers, color="#4c72b0")
    right.bar(labels, held, color="#dd8452")
    for ax, values, fmt in ((left, gathers, "{:d}"), (right, held, "{:.2f}")):
        for x, v in enumerate(values):
            ax.text(x, v, fmt.format(v), ha="center", va="bottom", fontsize=8)
        ax.set_xlabel("persistence threshold (elements)")
        ax.margins(y=0.15)
    left.set_ylabel("all-gathers per step")
    left.set_title("fewer collectives...", fontsize=9)
    right.set_ylabel("MB of parameters held")
    right.set_title("...for more parameters held at the end of backward", fontsize=9)
    fig.suptitle(f"ZeRO-3 on fine units, {n} ranks: small units kept whole", fontsize=10)
    fig.tight_layout()
    return fig


def owner_exchange(rows: dict, held: list, n: int, heat_title: str = "ZeRO-3"):
    """Left: each flat buffer (one row per bucket or unit, its padded length drawn as 1) with the
    N rank slices; the matrices a whole-matrix optimizer steps in grey, those a slice's edge cuts in
    the colour of their owner (the rank with the largest piece). rows: {label: (padded, [(offset,
    size, whole?)])}. Right: held[r][o], the elements rank r sends to owner o in the exchange."""
    from matplotlib.patches import Rectangle
    from .per_parameter_demo import cut_pieces
    colors = plt.get_cmap("tab10")
    fig, (ax, hx) = plt.subplots(1, 2, figsize=(10, 0.45 * len(rows) + 2.0), gridspec_kw={"width_ratios": [2.2, 1]})
    for y, (label, (padded, params)) in enumerate(rows.items()):
        for o, k, whole in params:
            if whole:
                ax.add_patch(Rectangle((o / padded, y - 0.3), k / padded, 0.6, color="0.82", ec="white", lw=0.4))
        for cut in cut_pieces([(padded, params)], n):
            for r, piece in cut["pieces"].items():
                lo = max(cut["offset"], r * padded // n)
                ax.add_patch(Rectangle((lo / padded, y - 0.3), piece / padded, 0.6, color=colors(cut["owner"]),
                                       alpha=1.0 if r == cut["owner"] else 0.45, ec="black", lw=0.6))
    for r in range(1, n):
        ax.axvline(r / n, color="black", lw=1)
    for r in range(n):
        ax.text((r + 0.5) / n, -0.75, f"rank {r}'s slice", ha="center", fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_ylim(len(rows) - 0.4, -1.0)
    ax.set_yticks(range(len(rows)), [label if any(w for _, _, w in params) else f"{label} (no matrix)"
                                     for label, (_, params) in rows.items()], fontsize=8)
    ax.set_xlabel("position in the flat buffer (fraction of its padded length)")
    ax.set_title("cut matrices (colour: the owner; pale: a piece it receives)", fontsize=9)
    im = hx.imshow(held, cmap="Blues")
    for r in range(n):
        for o in range(n):
            hx.text(o, r, f"{held[r][o]:,}" if held[r][o] else "", ha="center", va="center", fontsize=7,
                    color="white" if held[r][o] > 0.6 * max(max(row) for row in held) else "black")
    hx.set_xticks(range(n))
    hx.set_yticks(range(n))
    hx.set_xlabel("owner")
    hx.set_ylabel("rank holding a piece")
    hx.set_title(f"{heat_title}: elements to each owner", fontsize=8)
    fig.colorbar(im, ax=hx, shrink=0.7, pad=0.04).set_label("elements", fontsize=8)
    fig.suptitle("Whole-matrix optimizer on flat shards: who steps each cut matrix", fontsize=10)
    fig.tight_layout()
    return fig


def optimizer_state(per_rank: dict):
    """Optimizer-state bytes on each rank (per_rank: {label: [bytes of rank 0, 1, ...]}): AdamW's
    spread exactly 1/N, a whole-matrix optimizer's owners holding whole matrices' state."""
    import numpy as np
    labels = list(per_rank)
    n = len(per_rank[labels[0]])
    fig, ax = plt.subplots(figsize=(8, 3.0))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ax.bar(np.arange(n) - 0.4 + width * (i + 0.5), [b / 1e6 for b in per_rank[label]], width, label=label)
    ax.set_xticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylabel("MB of optimizer state")
    ax.set_title("Optimizer state per rank: AdamW spreads it evenly, Muon's owners hold whole matrices", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig
