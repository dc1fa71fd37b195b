"""Chapter 15's figures, drawn from what its exhibits ran: the two ranks' collectives as the flight
recorder kept them, LAMB's trust ratio on flat slices, the shards' gradient norms, the weights of
the tokens under accumulation, and the memory a ZeRO-2 rank holds at four moments."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

OP_COLORS = {"broadcast": "#55a868", "reduce_scatter": "#4c72b0", "all_gather": "#dd8452", "all_reduce": "#8c8c8c"}
OP_SHORT = {"broadcast": "BC", "reduce_scatter": "RS", "all_gather": "AG", "all_reduce": "AR"}


def parting(records: dict, at: int):
    """The collectives each rank entered, #1 to #at (the recorder's entries: records = {rank:
    RankRecord}), one lane per rank, coloured by operation and labelled with the line of the
    script that led to it; the first place where the lanes differ is framed in red."""
    ranks = sorted(records)
    fig, ax = plt.subplots(figsize=(10, 1.1 + 0.8 * len(ranks)))
    for y, rank in enumerate(ranks):
        for e in records[rank].entries:
            if 1 <= e.index <= at:
                ax.barh(y, 0.9, left=e.index - 0.45, height=0.6, color=OP_COLORS.get(e.op, "#cccccc"),
                        edgecolor="red" if e.index == at else "white", lw=2.2 if e.index == at else 0.5)
                ax.text(e.index, y - 0.05, OP_SHORT.get(e.op, e.op), ha="center", va="center", fontsize=7,
                        color="white")
                ax.text(e.index, y + 0.2, e.site.split(":")[-1] if e.site else "", ha="center", va="center",
                        fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xticks(range(1, at + 1))
    ax.set_xlim(0.4, at + 0.6)
    ax.set_xlabel("collective number (each rank's own count); small figures: the line of train.py")
    ax.set_title(f"The flight recorder's entries: the ranks part at collective #{at}", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in OP_COLORS.values()]
    ax.legend(handles, [f"{OP_SHORT[op]}: {op}" for op in OP_COLORS], loc="upper left", bbox_to_anchor=(1.01, 1),
              fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def trust_ratios(t: dict):
    """LAMB's trust ratio on every element (t: museum_reference.trust_ratios()): per tensor in one
    process, per slice over flat partitions; the tensors shaded, the slices' edges dashed."""
    fig, ax = plt.subplots(figsize=(10, 3.0))
    x = np.arange(t["total"])
    for i, (name, o, k) in enumerate(zip(t["names"], t["offsets"], t["sizes"])):
        ax.axvspan(o - 0.5, o + k - 0.5, color="0.93" if i % 2 == 0 else "white", zorder=0)
        ax.text(o + k / 2, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7)
    ax.step(x, t["one process"], where="mid", color="black", lw=1.6, label="one process: one ratio per tensor")
    ax.step(x, t["flat partitions"], where="mid", color="#c44e52", lw=1.6, ls="--",
            label="flat partitions: one ratio per slice")
    for edge in t["edges"]:
        ax.axvline(edge - 0.5, color="#c44e52", lw=0.8, ls=":")
    ax.set_xlim(-0.5, t["total"] - 0.5)
    ax.set_xlabel("element of the parameters laid end to end (the slices' edge dotted)")
    ax.set_ylabel("trust ratio ||w|| / ||update||")
    ax.set_title("LAMB's first step: the ratio each element is scaled by", fontsize=10, pad=14)
    ax.margins(y=0.12)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def shard_norms(cases: dict, one_process: float):
    """Squared gradient norms of each rank's shard, stacked (cases: {library: [norm of rank 0's
    shard, rank 1's, ...]}), beside the global batch's squared norm in one process: the global
    norm is the square root of their sum."""
    fig, ax = plt.subplots(figsize=(8, 2.6))
    colors = plt.get_cmap("tab10")
    for y, (label, norms) in enumerate(cases.items()):
        left = 0.0
        for r, norm in enumerate(norms):
            ax.barh(y, norm ** 2, left=left, color=colors(r), edgecolor="white",
                    label=f"rank {r}'s shard" if y == 0 else None)
            left += norm ** 2
    ax.axvline(one_process ** 2, color="black", ls="--", lw=1.2, label="one process, global batch")
    ax.set_yticks(range(len(cases)), list(cases))
    ax.invert_yaxis()
    ax.set_xlabel("squared gradient norm")
    ax.set_title("The shards' norms add in squares to the global norm", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def token_weights(w: dict):
    """Left: the weight one token gets in the step's gradient, micro-batch by micro-batch, under the
    habit and under the token mean (w: museum_reference.token_weights()). Right: each micro-batch's
    share of the step (weight x tokens)."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.0), sharey=True)
    y = np.arange(len(w["labels"]))
    for axis, key, xlabel in ((ax, None, "weight of one token"), (bx, "share", "share of the step's gradient")):
        for dy, name, color in ((-0.2, "habit", "#c44e52"), (0.2, "token mean", "#4c72b0")):
            values = w[name] if key is None else [v * n for v, n in zip(w[name], w["tokens"])]
            axis.barh(y + dy, values, height=0.38, color=color,
                      label="each micro-batch's mean / 2" if name == "habit" else "token mean")
        axis.set_xlabel(xlabel)
    ax.set_yticks(y, [f"{label} ({n} token{'s' if n != 1 else ''})" for label, n in zip(w["labels"], w["tokens"])],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_title("one token of a short micro-batch weighs more...", fontsize=9)
    bx.set_title("...and every micro-batch gets a quarter", fontsize=9)
    bx.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.suptitle("Gradient accumulation with padding: what each token counts for", fontsize=10)
    fig.tight_layout()
    return fig


def memory_moments(seen: dict, formula: float):
    """What a ZeRO-2 rank holds at each moment (seen: {moment: memory_report()}), stacked by kind,
    beside the paper's formula for the model states."""
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}
    fig, ax = plt.subplots(figsize=(8, 2.9))
    moments = list(seen)
    for y, moment in enumerate(moments):
        left = 0.0
        for key, color in colors.items():
            v = seen[moment][key] / 1e3
            ax.barh(y, v, left=left, color=color, label=key if y == 0 else None, edgecolor="white")
            left += v
    ax.axvline(formula / 1e3, color="black", ls="--", lw=1.2, label="the formula")
    ax.set_yticks(range(len(moments)), moments)
    ax.invert_yaxis()
    ax.set_xlabel("kB held by rank 0")
    ax.set_title("ZeRO-2 with AdamW: the formula describes one moment", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig
