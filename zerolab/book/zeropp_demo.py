"""Runs and figures for chapter 12 (ZeRO++ and HSDP): launched workers, closed forms, schematics.

Everything measured comes from `train_options`, one launch of 4 ranks = 2 pretend nodes x 2
ranks (zl.Topology(2)) that trains the nano GPT with each option in turn. The closed forms here
are derived from the model's parameter counts, never from the engine's layout, so a test of one
against the other means something.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.theory import cost_model as cm
from zerolab import quantize as qz
from zerolab.data import CharDataset
from zerolab.models import GPT, gpt_config, gpt_loss

N, G = 4, 2                      # ranks, ranks per node
M = N // G                       # nodes
SIZE, B = "nano", 4              # the GPT and its rows per rank
OPT = partial(torch.optim.AdamW, lr=3e-3)
QW, HP, QG, HSDP = ({"quantize_weights": True}, {"secondary_partition": "node"},
                    {"quantize_gradients": True}, {"shard_group": "node"})
OPTIONS = {"ZeRO-3": {}, "qwZ": QW, "hpZ": HP, "qgZ": QG, "qwZ+hpZ+qgZ": {**QW, **HP, **QG}, "HSDP": HSDP}
SMALL_TAGS = ("check", "used", "grad_norm")     # the engine's tiny bookkeeping collectives
WEIGHT_BLOCK, GRAD_BLOCK = 64, 32                # as zerolab.engines.zero3.zeropp chooses


def model():
    torch.manual_seed(0)
    return GPT(gpt_config(SIZE))


def _step(eng, data, s, rank, n, between=None):
    _, loss = gpt_loss(eng, data.batch(s, B, rank, n))
    if between is not None:
        between()
    eng.backward(loss)
    eng.step()
    eng.zero_grad()
    return loss.item()


def _measure(eng, data, s, rank, n):
    """Train one step with the ledger reset first: its bytes by link class and phase, and the
    memory held after forward (before backward: hpZ's secondary shards are alive then)."""
    eng.comm.reset()
    mem = {}
    loss = _step(eng, data, s, rank, n, between=lambda: mem.update(eng.memory_report()))
    start, end = eng.last_backward["start"], eng.last_backward["end"]
    recs = [(r.tag.split(":")[0], r.op, r.bytes_sent, r.bytes_inter or 0,
             "backward" if start <= r.start <= end else "forward") for r in eng.comm.records
            if r.tag.split(":")[0] not in SMALL_TAGS]
    after = eng.memory_report()
    return loss, {"recs": recs, "mem_fwd": {k: mem[k] for k in ("params", "grads", "optimizer", "total")},
                  "mem_step": {k: after[k] for k in ("params", "grads", "optimizer", "total")}}


def _engine(name, **kw):
    eng = zl.ZeRO(model(), OPT, stage=3, topology=G, track_peak=False, **OPTIONS[name], **kw)
    eng.comm.timeout = None      # no collective timeout: wait as long as gloo allows
    return eng


CURVES = ("qwZ", "qgZ", "qwZ+hpZ+qgZ")   # the options that change the numbers: trained long


def train_options(steps=120, short=10, curves=CURVES, bf16_steps=2):
    """Every option in one launch, on 2 pretend nodes of 2 ranks. fp32: the options in `curves`
    train `steps` steps, the others (ZeRO-3 and the exact options, hpZ and HSDP) `short` steps;
    step 1 of each is measured (bytes by link class and phase, memory). bf16: `bf16_steps`
    steps of each, the last measured. Returns this rank's losses and measurements."""
    rank, n = dist.get_rank(), dist.get_world_size()
    data = CharDataset(gpt_config(SIZE).block_size)
    out = {"fp32": {}, "bf16": {}, "loss": {}}
    for name in OPTIONS:
        eng = _engine(name)
        losses = []
        for s in range(steps if name in curves else short):
            if s == 1:
                loss, out["fp32"][name] = _measure(eng, data, s, rank, n)
            else:
                loss = _step(eng, data, s, rank, n)
            losses.append(loss)
        out["loss"][name] = losses
    for name in OPTIONS:
        eng = _engine(name, precision="bf16")
        for s in range(bf16_steps - 1):
            _step(eng, data, s, rank, n)
        out["bf16"][name] = _measure(eng, data, bf16_steps - 1, rank, n)[1]
    if rank == 0:
        out["units"] = unit_numels()
    return out


def single_reference(steps=120):
    """One process on the global batch (N x B rows) with the same optimizer: ZeRO-3's losses
    (chapter 8 shows ZeRO-3 equals it to fp32 round-off), at a fraction of the cost."""
    from zerolab.engines.single import SingleProcess
    data = CharDataset(gpt_config(SIZE).block_size)
    eng = SingleProcess(model(), OPT, track_peak=False)
    losses = []
    for s in range(steps):
        _, loss = gpt_loss(eng, data.batch(s, B * N))
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
        losses.append(loss.item())
    return np.array(losses)


# ------------------------------------------------------------------ closed forms


def unit_numels():
    """Parameters per ZeRO-3 unit, counted from the model: the root (embeddings, final norm,
    head: whatever no block holds), then each block."""
    net = model()
    blocks = [sum(p.numel() for p in b.parameters()) for b in net.blocks]
    return [sum(p.numel() for p in net.parameters()) - sum(blocks)] + blocks


def _pad(n, k):
    return -(-n // k) * k


def closed_form(option, b, units=None, n=N, g=G):
    """Bytes one node sends per step, (across nodes, inside the node), summed over its g ranks.

    c: bytes per element of the compute dtype (4 fp32, 2 bf16). G ranks per node, N_node nodes.
    For a unit of P parameters (padded to a multiple of the ranks it is sharded over), P / N the shard:
      a ring over all N ranks (all-gather, reduce-scatter): each rank sends (N-1) (P / N) c; one rank
        per node (its last) sends to the next node, the G-1 others inside;
      qwZ's all-gather: the same ring with each piece as int8 codes + scales, qz.wire_bytes(s, 8, 64);
      hpZ's backward all-gather: a ring over the node's G ranks of P/G pieces: all inside;
      qgZ: an all-to-all inside the node of G rows of N_node P/N elements (int4 + scales), each rank
        keeping one row, then an all-to-all over the N_node nodes of N_node rows of P/N, keeping one;
      HSDP: rings over the node's G ranks for both all-gathers and the reduce-scatter, then an
        all-reduce of the 1/G shard over the N_node nodes, 2 (N_node-1)/N_node of it per rank, all across.
    """
    units = unit_numels() if units is None else units
    m = n // g
    inter = intra = 0
    for numel in units:
        P = _pad(numel, n)
        s = P // n
        ring = ((n - 1) * s * b, (g - 1) * (n - 1) * s * b)             # (inter, intra) per node
        qring = ((n - 1) * qz.wire_bytes(s, 8, WEIGHT_BLOCK), (g - 1) * (n - 1) * qz.wire_bytes(s, 8, WEIGHT_BLOCK))
        node_ring = (0, g * (g - 1) * (P // g) * b)
        qgz = (g * (m - 1) * qz.wire_bytes(s, 4, GRAD_BLOCK), g * (g - 1) * qz.wire_bytes(m * s, 4, GRAD_BLOCK))
        fwd = qring if option in ("qwZ", "qwZ+hpZ+qgZ") else ring
        bwd = node_ring if option in ("hpZ", "qwZ+hpZ+qgZ") else fwd
        red = qgz if option in ("qgZ", "qwZ+hpZ+qgZ") else ring
        parts = [fwd, bwd, red]
        if option == "HSDP":
            Pg = _pad(numel, g)
            hs = (0, g * (g - 1) * (Pg // g) * b)
            parts = [hs, hs, hs, (g * 2 * (m - 1) * (Pg // g) * b // m, 0)]
        inter += sum(p[0] for p in parts)
        intra += sum(p[1] for p in parts)
    return inter, intra


def measured_bytes(res, option, dtype="fp32", phase=None):
    """(across, inside) bytes per node per step: summed over the ranks, divided by the nodes."""
    recs = [r for rank in res for r in rank[dtype][option]["recs"] if phase is None or r[4] == phase]
    inter = sum(r[3] for r in recs)
    intra = sum(r[2] - r[3] for r in recs)
    return inter // M, intra // M


def table(res):
    """One row per option: bytes per node per step (measured, closed form) in fp32 and bf16, and
    the largest rank's model states after forward and after the step (fp32)."""
    psi = sum(res[0]["units"])
    rows = []
    for name in OPTIONS:
        row = {"option": name}
        for dtype, b in (("fp32", 4), ("bf16", 2)):
            row[dtype] = measured_bytes(res, name, dtype)
            row[dtype + "_closed"] = closed_form(name, b, res[0]["units"])
        row["mem_fwd"] = max(r["fp32"][name]["mem_fwd"]["total"] for r in res)
        row["mem_step"] = max(r["fp32"][name]["mem_step"]["total"] for r in res)
        row["params_fwd"] = max(r["fp32"][name]["mem_fwd"]["params"] for r in res)
        row["psi"] = psi
        rows.append(row)
    return rows


def mean_loss(res, option):
    """The loss of the global batch at each step: the mean of the ranks' losses (equal rows each)."""
    return np.mean([r["loss"][option] for r in res], axis=0)


# ------------------------------------------------------------------ the collectives, for the cost model


def option_collectives(option, psi, n, g, b=2):
    """The collectives one step of `option` runs for a psi-parameter model taken as one unit,
    on n GPUs in nodes of g, as zerolab.theory.cost_model.Collective records the cost model times.

    The same groups and payloads as closed_form (tests/test_cost_model.py checks that the bytes
    the cost model books per node are closed_form's): world rings of P b bytes, qwZ's of int8
    codes, hpZ's backward gather over the node's g ranks, qgZ's two all-to-alls of int4 codes
    (inside the node, then over the m nodes with one rank per node: g such groups share a node's
    network cards), and HSDP's rings inside the node plus an all-reduce of the 1/g shard across.
    """
    m = n // g
    P = _pad(int(psi), n)
    s = P // n
    world = lambda kind, nbytes, phase: cm.Collective(kind, nbytes, n, phase)          # noqa: E731
    full, q8 = P * b, n * qz.wire_bytes(s, 8, WEIGHT_BLOCK)
    fwd = world("all_gather", q8 if option in ("qwZ", "qwZ+hpZ+qgZ") else full, "forward")
    if option in ("hpZ", "qwZ+hpZ+qgZ"):
        bwd = cm.Collective("all_gather", full, g, "backward", ranks_per_node=g)
    else:
        bwd = world("all_gather", fwd.nbytes, "backward")
    if option in ("qgZ", "qwZ+hpZ+qgZ"):
        red = [cm.Collective("all_to_all", g * qz.wire_bytes(m * s, 4, GRAD_BLOCK), g, "backward", ranks_per_node=g),
               cm.Collective("all_to_all", m * qz.wire_bytes(s, 4, GRAD_BLOCK), m, "backward", ranks_per_node=1)]
    else:
        red = [world("reduce_scatter", full, "backward")]
    if option == "HSDP":
        Pg = _pad(int(psi), g) * b
        node = lambda kind, phase: cm.Collective(kind, Pg, g, phase, ranks_per_node=g)   # noqa: E731
        return [node("all_gather", "forward"), node("all_gather", "backward"), node("reduce_scatter", "backward"),
                cm.Collective("all_reduce", Pg // g, m, "backward", ranks_per_node=1)]
    return [fwd, bwd, *red]


def option_costs(psi, n, cluster, b=2):
    """{option: [cost_model.Cost of each collective]} for a psi-parameter model on n GPUs."""
    return {name: [c.cost(cluster) for c in option_collectives(name, psi, n, cluster.gpus_per_node, b)]
            for name in OPTIONS}


# ------------------------------------------------------------------ figures

INTER_COLOR, INTRA_COLOR = "#d62728", "#1f77b4"


def _ring(ranks):
    return [(a, b) for a, b in zip(ranks, ranks[1:] + ranks[:1])]


def _arrows(option, row, n=N, g=G):
    """(src, dst, label) for one row of the schematic: 0 forward all-gather, 1 backward
    all-gather, 2 gradient reduction. Ranks are torchrun's: node = rank // g."""
    world = list(range(n))
    nodes = [list(range(k * g, (k + 1) * g)) for k in range(n // g)]
    cross = [list(range(i, n, g)) for i in range(g)]
    node_rings = [e for ranks in nodes for e in _ring(ranks)]
    cross_pairs = [(a, b) for ranks in cross for a, b in _ring(ranks)]
    if option == "HSDP":
        if row < 2:
            return [(a, b, "full") for a, b in node_rings]
        return [(a, b, "full") for a, b in node_rings] + [(a, b, "shard") for a, b in cross_pairs]
    if row == 0 or (row == 1 and option not in ("hpZ", "qwZ+hpZ+qgZ")):
        label = "int8" if option in ("qwZ", "qwZ+hpZ+qgZ") else "full"
        return [(a, b, label) for a, b in _ring(world)]
    if row == 1:                                   # hpZ: the node's secondary shards
        return [(a, b, "full") for a, b in node_rings]
    if option in ("qgZ", "qwZ+hpZ+qgZ"):           # two all-to-alls of int4
        return [(a, b, "int4") for a, b in node_rings] + [(a, b, "int4 1/g") for a, b in cross_pairs]
    return [(a, b, "full") for a, b in _ring(world)]


def schematic(options, n=N, g=G):
    """One panel per option: the ranks (dots) in their nodes (boxes), and who sends to whom in
    the forward all-gather, the backward all-gather and the gradient reduction. Red arrows
    cross nodes, blue ones stay inside; a thin arrow carries int8 or int4 codes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle
    rows = ("forward\nall-gather", "backward\nall-gather", "gradient\nreduction")
    fig, axes = plt.subplots(1, len(options), figsize=(3.1 * len(options), 3.3), squeeze=False)
    x = {r: r + 0.6 * (r // g) for r in range(n)}      # a gap between nodes
    for ax, option in zip(axes[0], options):
        for i, name in enumerate(rows):
            y = -1.7 * i
            for k in range(n // g):
                x0 = x[k * g] - 0.35
                ax.add_patch(Rectangle((x0, y - 0.42), x[k * g + g - 1] - x[k * g] + 0.7, 0.84,
                                       fill=False, ls="--", lw=0.8, color="grey"))
            for r in range(n):
                ax.plot(x[r], y, "o", color="black", ms=9, zorder=3)
                ax.text(x[r], y, str(r), color="white", ha="center", va="center", fontsize=6, zorder=4)
            for a, b, label in _arrows(option, i, n, g):
                inter = a // g != b // g
                color = INTER_COLOR if inter else INTRA_COLOR
                lw = 2.4 if label == "full" else 1.6 if label == "shard" else 0.9
                ax.add_patch(FancyArrowPatch((x[a], y), (x[b], y), connectionstyle="arc3,rad=-0.28",
                                             arrowstyle="-|>", mutation_scale=8, lw=lw, color=color,
                                             shrinkA=6, shrinkB=6, zorder=2))
            tags = sorted({lab for _, _, lab in _arrows(option, i, n, g)} - {"full"})
            if tags:
                ax.text(x[n - 1] + 0.55, y, ", ".join(tags), fontsize=7, va="center")
            if ax is axes[0][0]:
                ax.text(-0.7, y, name, fontsize=7, ha="right", va="center")
        ax.set_title(option, fontsize=9)
        ax.set_xlim(-2.2, x[n - 1] + 1.6)
        ax.set_ylim(-1.7 * (len(rows) - 1) - 0.95, 0.75)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle(f"Who sends to whom: {n // g} nodes of {g} ranks (red: across nodes, blue: inside)", fontsize=10)
    fig.tight_layout()
    return fig


def bytes_figure(rows):
    """Measured bytes per node per step, across nodes (red) and inside (blue), fp32 and bf16."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    names = [r["option"] for r in rows]
    y = np.arange(len(names))
    for ax, dtype in zip(axes, ("fp32", "bf16")):
        inter = np.array([r[dtype][0] for r in rows]) / 1e3
        intra = np.array([r[dtype][1] for r in rows]) / 1e3
        ax.barh(y, inter, color=INTER_COLOR, label="across nodes")
        ax.barh(y, intra, left=inter, color=INTRA_COLOR, alpha=0.6, label="inside a node")
        ax.set_yticks(y, names)
        ax.set_xlabel("kB per node per step")
        ax.set_title(f"{dtype} (measured)", fontsize=9)
    axes[0].invert_yaxis()                     # shared: once for both
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Bytes per node per step, by the link they cross", fontsize=10)
    fig.tight_layout()
    return fig


def loss_figure(curves, reference, window=15):
    """Left: the loss per step (thin) and its running mean over `window` steps (thick), one line
    per option. Right: each running mean's gap to the reference's, in percent, beside +-1 %."""
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.3))
    smooth = lambda x: np.convolve(np.asarray(x), np.ones(window) / window, mode="valid")   # noqa: E731
    ref = smooth(curves[reference])
    steps = np.arange(window - 1, window - 1 + len(ref))
    for name, losses in curves.items():
        line, = ax.plot(steps, smooth(losses), lw=1.6, label=name)
        ax.plot(losses, lw=0.5, alpha=0.35, color=line.get_color())
        if name != reference:
            bx.plot(steps, 100 * (smooth(losses) / ref - 1), lw=1.2, color=line.get_color(), label=name)
    bx.axhspan(-1, 1, color="grey", alpha=0.15, label="1 % of the reference")
    bx.axhline(0, color="black", lw=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.legend(fontsize=7)
    bx.set_xlabel("step")
    bx.set_ylabel(f"gap to {reference} (%)", fontsize=8)
    bx.legend(fontsize=7)
    fig.suptitle("Training loss with the quantized options, beside one process", fontsize=10)
    fig.tight_layout()
    return fig


def cost_figure(panels):
    """One panel per cluster, panels = [(title, {option: [cost_model.Cost]}, compute_s)]: seconds of
    communication per step per option, each collective a block coloured by what bounds it (the
    network, NVLink, or latency), beside the step's compute (dotted)."""
    import matplotlib.pyplot as plt
    colors = {"network": INTER_COLOR, "NVLink": INTRA_COLOR, "latency": "#7f7f7f"}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.1), squeeze=False)
    for ax, (title, costs, compute_s) in zip(axes[0], panels):
        names = list(costs)
        for y, name in enumerate(names):
            left = 0.0
            for c in costs[name]:
                ax.barh(y, c.seconds * 1e3, left=left, color=colors[c.bound_by], edgecolor="white", lw=0.6,
                        alpha=1.0 if c.bound_by == "network" else 0.6)
                left += c.seconds * 1e3
        ax.axvline(compute_s * 1e3, color="black", ls=":", lw=1)
        ax.text(compute_s * 1e3, len(names) - 0.4, " compute", fontsize=7, va="bottom")
        ax.set_yticks(range(len(names)), names if ax is axes[0][0] else [""] * len(names))
        ax.invert_yaxis()
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("ms per step, one block per collective", fontsize=8)
    from matplotlib.patches import Patch
    axes[0][-1].legend(handles=[Patch(color=color, alpha=1.0 if label == "network" else 0.6, label=f"bound by {label}")
                                for label, color in colors.items()], fontsize=7, loc="lower right")
    fig.suptitle("Communication per step from the cost model, by option", fontsize=10)
    fig.tight_layout()
    return fig
