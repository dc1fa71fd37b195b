"""Chapter 8: when ZeRO-3's extra all-gather stops hiding behind compute, from the cost model.

Built on zerolab.theory.cost_model (collectives on NVLink and the nodes' network cards, and a step
estimate on a GPU cluster); nothing measured here: the numbers are what the model says for the
hardware it assumes.

    hiding_rows(psi, tokens_per_rank, ns)      DDP and ZeRO-3 per world size: compute, traffic,
                                               exposed traffic, and the tokens per GPU that hide it
    exposed_ms(stage, psi, n, tokens)          exposed milliseconds per step, for a range of batches
    unit_latency_s(n, units, cluster)          the latency if every unit is gathered and reduced on
                                               its own (the step estimate counts one collective per kind)
"""

from __future__ import annotations

from ..theory import cost_model as cm


def hiding_rows(psi: float, tokens_per_rank: float, ns=(8, 16, 64, 384, 512, 4096),
                cluster: cm.Cluster = cm.H100_CLUSTER) -> list[dict]:
    """Per world size: the nodes, compute, and for DDP and ZeRO-3 the step's communication and
    the part compute cannot hide (cost_model.step_estimate), and the tokens per GPU that would
    hide ZeRO-3's (cost_model.min_tokens_to_hide, latency included)."""
    rows = []
    for n in ns:
        ddp = cm.step_estimate(0, psi, n, tokens_per_rank, cluster)
        z3 = cm.step_estimate(3, psi, n, tokens_per_rank, cluster)
        rows.append({"n": n, "nodes": -(-n // cluster.gpus_per_node),
                     "compute_ms": 1e3 * z3.compute_s,
                     "ddp_comm_ms": 1e3 * ddp.comm_s, "ddp_exposed_ms": 1e3 * ddp.exposed_s,
                     "z3_comm_ms": 1e3 * z3.comm_s, "z3_exposed_ms": 1e3 * z3.exposed_s,
                     "hide_tokens": cm.min_tokens_to_hide(3, psi, n, cluster)})
    return rows


def format_hiding_rows(rows) -> str:
    lines = ["| GPUs | links | compute (ms) | DDP: comm / exposed (ms) | ZeRO-3: comm / exposed (ms) | "
             "tokens per GPU to hide |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        over = "NVLink, 1 node" if r["nodes"] == 1 else f"NVLink + network, {r['nodes']:,} nodes"
        lines.append(f"| {r['n']:,} | {over} | {r['compute_ms']:,.0f} | {r['ddp_comm_ms']:,.0f} / "
                     f"{r['ddp_exposed_ms']:,.0f} | {r['z3_comm_ms']:,.0f} / {r['z3_exposed_ms']:,.0f} | "
                     f"{r['hide_tokens']:,.0f} |")
    return "\n".join(lines)


def unit_latency_s(n: int, units: int, cluster: cm.Cluster = cm.H100_CLUSTER) -> float:
    """The latency part of ZeRO-3's collectives when each unit has its own: 3 collectives per
    unit (gather for forward, gather for backward, reduce-scatter), each paying the ring's
    latency (cost_model's: a call, plus a step per rank, the network's on the steps that cross
    nodes)."""
    per_unit = sum(cm.collective_cost(kind, 1.0, n, cluster).latency_s
                   for kind in ("all_gather", "all_gather", "reduce_scatter"))
    return units * per_unit


def exposed_ms(stage: int, psi: float, n: int, tokens, cluster: cm.Cluster = cm.H100_CLUSTER) -> list:
    """Milliseconds of communication the step cannot hide (cost_model.step_estimate), for each
    number of tokens per GPU in `tokens`: stage 0 is DDP, 3 is ZeRO-3."""
    return [1e3 * cm.step_estimate(stage, psi, n, t, cluster).exposed_s for t in tokens]
