"""Chapter 8: when ZeRO-3's extra all-gather stops hiding behind compute, from the cost model.

Built on zerolab.cost_model (alpha-beta ring collectives and a step estimate on a GPU cluster),
nothing measured here: the numbers are what the model says for the hardware it assumes.

    assumptions(cluster)                       the hardware figures, one row each
    hiding_rows(psi, tokens_per_rank, ns)      DDP and ZeRO-3 per world size: compute, traffic,
                                               exposed traffic, and the tokens per GPU that hide it
    hide_threshold_tokens(n, cluster)          that threshold in closed form: (N-1)/N * F / B
    unit_latency_s(n, units, cluster)          the ring's latency if every unit is gathered and
                                               reduced on its own (the step estimate counts one
                                               collective per kind)
"""

from __future__ import annotations

from .. import cost_model as cm


def assumptions(cluster: cm.Cluster = cm.H100_CLUSTER) -> list[tuple[str, str]]:
    """(what, value) for each hardware figure the estimates rest on."""
    return [("GPUs per node", f"{cluster.gpus_per_node}"),
            ("inside a node", f"{cluster.intra.name}: {cluster.intra.bandwidth_Bps / 1e9:g} GB/s per GPU each way, "
                              f"{cluster.intra.alpha_s * 1e6:g} µs per ring step"),
            ("between nodes", f"{cluster.inter.name}: {cluster.inter.bandwidth_Bps / 1e9:g} GB/s per GPU each way, "
                              f"{cluster.inter.alpha_s * 1e6:g} µs per ring step"),
            ("compute", f"{cluster.peak_flops / 1e12:g} TFLOP/s bf16 peak at {cluster.mfu:.0%} utilisation = "
                        f"{cluster.achieved_flops / 1e12:.1f} TFLOP/s per GPU")]


def hide_threshold_tokens(n: int, cluster: cm.Cluster = cm.H100_CLUSTER, bytes_per_element: int = 2) -> float:
    """Tokens per GPU above which ZeRO-3's collectives hide, bandwidth part only.

    The forward all-gather sends (N-1)/N * 2 Psi bytes (bf16) in (N-1)/N * 2 Psi / B seconds;
    the forward computes 2 Psi FLOPs per token (a third of 6 Psi) in 2 Psi T / F seconds. Equal
    when T = (N-1)/N * F / B (for 2-byte elements): the model size cancels. The backward's
    all-gather and reduce-scatter are twice the bytes against twice the compute: the same T.
    So is DDP's all-reduce (2 Psi in the backward), which is why both reach it together.
    """
    link = cm.bottleneck_link(n, cluster)
    return (n - 1) / n * cluster.achieved_flops * bytes_per_element / (2 * link.bandwidth_Bps)


def hiding_rows(psi: float, tokens_per_rank: float, ns=(8, 16, 64, 512, 4096),
                cluster: cm.Cluster = cm.H100_CLUSTER) -> list[dict]:
    """Per world size: the link, compute, and for DDP and ZeRO-3 the step's communication and
    the part compute cannot hide (cost_model.step_estimate), and the tokens per GPU that would
    hide ZeRO-3's (cost_model.min_tokens_to_hide, latency included)."""
    rows = []
    for n in ns:
        ddp = cm.step_estimate(0, psi, n, tokens_per_rank, cluster)
        z3 = cm.step_estimate(3, psi, n, tokens_per_rank, cluster)
        rows.append({"n": n, "nodes": -(-n // cluster.gpus_per_node), "link": cm.bottleneck_link(n, cluster).name,
                     "compute_ms": 1e3 * z3.compute_s,
                     "ddp_comm_ms": 1e3 * ddp.comm_s, "ddp_exposed_ms": 1e3 * ddp.exposed_s,
                     "z3_comm_ms": 1e3 * z3.comm_s, "z3_exposed_ms": 1e3 * z3.exposed_s,
                     "hide_tokens": cm.min_tokens_to_hide(3, psi, n, cluster)})
    return rows


def format_hiding_rows(rows) -> str:
    lines = ["| GPUs | ring over | compute (ms) | DDP: comm / exposed (ms) | ZeRO-3: comm / exposed (ms) | "
             "tokens per GPU to hide |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        over = "NVLink, 1 node" if r["nodes"] == 1 else f"network, {r['nodes']:,} nodes"
        lines.append(f"| {r['n']:,} | {over} | {r['compute_ms']:,.0f} | {r['ddp_comm_ms']:,.0f} / "
                     f"{r['ddp_exposed_ms']:,.0f} | {r['z3_comm_ms']:,.0f} / {r['z3_exposed_ms']:,.0f} | "
                     f"{r['hide_tokens']:,.0f} |")
    return "\n".join(lines)


def unit_latency_s(n: int, units: int, cluster: cm.Cluster = cm.H100_CLUSTER) -> float:
    """The latency part of ZeRO-3's collectives when each unit has its own: 3 collectives per
    unit (gather for forward, gather for backward, reduce-scatter), N-1 ring steps each, every
    step charged the ring's slowest link (the cost model's flat ring, a pessimistic bound)."""
    link = cm.bottleneck_link(n, cluster)
    return 3 * units * cm.ring_steps("all_gather", n) * link.alpha_s
