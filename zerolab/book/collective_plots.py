"""Chapter 4's pictures of what moves where: who sends to whom in each collective, and the bytes
each rank sent against the ring's formula.

* `senders(op, n)`: the messages of one collective as the ledger books them, [(from, to)];
* `movement_figure(sent, n)`: one panel per collective, ranks on a circle, an arrow per message,
  each arrow labelled with the numbers the sending rank's ledger says it sent;
* `bytes_vs_ranks_figure(rows, tensor_bytes)`: measured bytes per rank over S against N, beside
  the ring's (N-1)/N and 2(N-1)/N and the paper's large-N limits.
"""

from __future__ import annotations

import math

OPS = ("broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather")
NAMES = {"broadcast": "broadcast (a chain from rank 0)", "reduce": "reduce (everyone to rank 0)",
         "all_reduce": "all-reduce (ring)", "reduce_scatter": "reduce-scatter (ring)",
         "all_gather": "all-gather (ring)"}
COLORS = {"broadcast": "#4C72B0", "reduce": "#C44E52", "all_reduce": "#8172B3",
          "reduce_scatter": "#DD8452", "all_gather": "#55A868"}


def senders(op: str, n: int, root: int = 0) -> list:
    """[(from, to)]: the links one collective uses, as zerolab's ledger books its bytes.

    broadcast: a chain from the root (each rank but the last passes the tensor on); reduce: every
    rank sends its tensor to the root (zerolab.theory.collectives.naive_reduce); the others: the
    ring, each rank sending to its right neighbour."""
    if op == "broadcast":
        chain = [(root + i) % n for i in range(n)]
        return list(zip(chain[:-1], chain[1:]))
    if op == "reduce":
        return [(r, root) for r in range(n) if r != root]
    if op in ("all_reduce", "reduce_scatter", "all_gather"):
        return [(r, (r + 1) % n) for r in range(n)] if n > 1 else []
    raise ValueError(f"senders: unknown collective {op!r}; expected one of {OPS}")


def _position(r: int, n: int):
    """Rank r on a circle, rank 0 at the top, clockwise."""
    a = math.pi / 2 - 2 * math.pi * r / n
    return math.cos(a), math.sin(a)


def movement_figure(sent: list, element_size: int = 4):
    """sent: one dict per rank {op: bytes this rank sent}, from each rank's ledger.

    One panel per collective: the ranks on a circle, an arrow for each link the collective uses
    (senders()), labelled with how many numbers the sending rank sent over it, and under each
    rank the bytes its ledger booked."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    n = len(sent)
    fig, axes = plt.subplots(1, len(OPS), figsize=(2.3 * len(OPS), 2.9))
    for ax, op in zip(axes, OPS):
        color = COLORS[op]
        for a, b in senders(op, n):
            (x0, y0), (x1, y1) = _position(a, n), _position(b, n)
            straight = op == "reduce" or (x0 + x1) ** 2 + (y0 + y1) ** 2 < 1e-9
            ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), connectionstyle=f"arc3,rad={0 if straight else -0.3}",
                                         arrowstyle="-|>", mutation_scale=12, color=color, lw=1.6,
                                         shrinkA=13, shrinkB=13))
            mx, my = (x0 + x1) / 2, (y0 + y1) / 2
            norm = math.hypot(mx, my)
            if norm < 1e-6:                      # an arrow through the centre: label it beside
                lx, ly = mx + 0.16, my - 0.2
            else:                                # outside the ring, beside the arc's middle
                out = (norm + (0.55 if not straight else -0.2)) / norm
                lx, ly = mx * out, my * out
            ax.text(lx, ly, f"{sent[a][op] // element_size}", ha="center", va="center", fontsize=8.5,
                    color=color, fontweight="bold")
        for r in range(n):
            x, y = _position(r, n)
            ax.add_patch(plt.Circle((x, y), 0.2, color="#f0f0f0", ec="black", lw=0.8, zorder=3))
            ax.text(x, y, str(r), ha="center", va="center", fontsize=9, zorder=4)
            ax.text(x * 1.5, y * 1.5 - (0.05 if y < -0.5 else 0), f"{sent[r][op]} B", ha="center", va="center",
                    fontsize=7, color="#444444")
        total = sum(s[op] for s in sent)
        ax.set_title(f"{NAMES[op]}\n{total} bytes in all", fontsize=8.5)
        ax.set_xlim(-1.75, 1.75)
        ax.set_ylim(-1.75, 1.75)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle(f"What moves where: {n} ranks, {n} fp32 numbers each. Coloured: numbers sent over a link; "
                 "grey: bytes each rank's ledger booked", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def ring_factor(op: str, n: float) -> float:
    """Bytes each rank sends in a ring collective, over S: (N-1)/N, or 2(N-1)/N for all-reduce."""
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


def bytes_vs_ranks_figure(rows, tensor_bytes: int, n_max: int = 64):
    """rows: [(N, op, bytes sent per rank, formula)] as chapter 4 measures them.

    Measured points over S against N, the ring's curves from 2 to n_max ranks, and the paper's
    large-N values (Psi for reduce-scatter and all-gather, 2 Psi for all-reduce) as dotted lines."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ns = [2 + i * (n_max - 2) / 200 for i in range(201)]
    for op, label, color in (("all_reduce", "all-reduce: 2(N-1)/N", COLORS["all_reduce"]),
                             ("reduce_scatter", "reduce-scatter and all-gather: (N-1)/N", COLORS["reduce_scatter"])):
        ax.plot(ns, [ring_factor(op, n) for n in ns], "-", color=color, lw=1.2, label=label)
        limit = 2 if op == "all_reduce" else 1
        ax.axhline(limit, color=color, ls=":", lw=1)
        ax.text(n_max, limit + 0.04, f"the paper's large-N value, {limit}", ha="right", va="bottom",
                fontsize=8, color=color)
    for op, marker in (("all_reduce", "o"), ("reduce_scatter", "s"), ("all_gather", "^")):
        pts = [(n, sent / tensor_bytes) for n, o, sent, _ in rows if o == op]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, ms=6, mfc="none",
                color=COLORS[op], label=f"measured, {op.replace('_', '-')}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([2, 3, 4, 8, 16, 32, 64], ["2", "3", "4", "8", "16", "32", "64"])
    ax.set_ylim(0, 2.3)
    ax.set_xlabel("ranks N (log scale)")
    ax.set_ylabel("bytes sent per rank / S")
    ax.set_title(f"Bytes each rank sends, measured by the ledger (S = {tensor_bytes:,} bytes)", fontsize=9)
    ax.legend(fontsize=7.5, loc="lower right")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig
