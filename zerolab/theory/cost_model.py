"""The book's one cost model: how long collectives and training steps take on a GPU cluster, on paper.

The book's runs use gloo on a laptop CPU, whose timings say little about a GPU cluster. Every chapter
that quotes a time on a cluster asks this module instead (chapters 4, 5, 8, 10 and 12), and
`zerolab.book.cost_checks` sets it beside published measurements.

    from zerolab.theory import cost_model as cm
    cm.collective_seconds("all_reduce", 2 * 7e9, 8, cm.H100_CLUSTER)     # 7B bf16 grads, one node
    cm.step_estimate(stage=3, psi=7e9, n=64, tokens_per_rank=4096, cluster=cm.H100_CLUSTER)

1. Links. A GPU reaches the GPUs of its node over NVLink (through NVSwitch), and other nodes
   through the node's network cards (NICs). Each link has a datasheet rate, the share of it
   NCCL's kernels deliver (its protocol overhead), and a latency per message step.
2. Collectives. In the ring algorithm (chapter 4) each rank sends (N-1)/N of the tensor for a
   reduce-scatter or an all-gather, twice that for an all-reduce. Across nodes NCCL runs several
   rings at once, one or more per NIC, each leaving a node through one hop: per node the network
   carries one rank's bytes in all, spread over every NIC, while each GPU sends the rest, (G-1)/G
   of its bytes (G of its ranks per node), over NVLink, at the same time; the slower link sets the
   time. NCCL's tree all-reduce moves the same bytes at 0.92 of the ring's bandwidth, with a
   latency that grows with log2(nodes) instead of N; "auto" picks the faster, as NCCL does: the
   tree for small messages across many nodes, the ring for large ones.
3. A training step: compute from the 6 * params * tokens rule at a stated fraction of the GPU's
   datasheet peak (MFU; chapter 10 derives it from a roofline, zerolab.theory.roofline),
   communication from the ZeRO paper's volumes (2 Psi for DDP, ZeRO-1 and ZeRO-2; 3 Psi for
   ZeRO-3), and the part of the communication the compute cannot hide.

Left out (zerolab.book.cost_checks shows what each costs against published measurements):
in-network reduction (NVLink SHARP on H100 NVSwitches, about 480 GB/s bus bandwidth against the
ring's 370, and SHARP on InfiniBand switches: the model's all-reduce is a floor on speed there);
congestion, stragglers, and the low-latency protocols NCCL uses below a few megabytes; and the
compute that overlapped NCCL kernels slow down (the exposed time below is a lower bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
ALGORITHMS = ("auto", "ring", "tree")


# ------------------------------------------------------------------ hardware, with its sources
@dataclass(frozen=True)
class Link:
    """One GPU's NVLink, or one network card, in ONE direction.
    line_rate_Bps: the datasheet rate in one direction (datasheets often add both directions).
    efficiency: the share of the line rate NCCL's kernels deliver (protocol overhead).
    alpha_s: seconds of latency per ring step over this link (NCCL's own tuning model);
    tree_alpha_s: per step of NCCL's tree, where it differs from the ring's (None: the same).
    """

    name: str
    line_rate_Bps: float
    efficiency: float
    alpha_s: float
    tree_alpha_s: float | None = None

    @property
    def bandwidth_Bps(self) -> float:
        """What NCCL can push through the link: line rate times efficiency."""
        return self.line_rate_Bps * self.efficiency


@dataclass(frozen=True)
class Cluster:
    """Nodes of gpus_per_node GPUs on NVLink, each node on the network through nics_per_node NICs.

    peak_flops: one GPU's dense datasheet peak for the training dtype (FLOP/s).
    mfu: model FLOPs utilisation, the fraction of that peak the step's arithmetic runs at: the
        literature's definition, 6 Psi FLOPs per token times tokens per second over the peak.
    """

    name: str
    gpus_per_node: int
    nvlink: Link
    nic: Link
    nics_per_node: int
    peak_flops: float
    mfu: float
    base_latency_s: float = 8.4e-6

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.mfu

    @property
    def network_Bps(self) -> float:
        """One node's bandwidth to the network, every NIC together, one direction."""
        return self.nics_per_node * self.nic.bandwidth_Bps


# Efficiencies, each set from one published figure (zerolab.book.cost_checks keeps the rows that restate them apart):
# - NVLink: "Each NVLink has a line rate of 25GB/s (in each direction) which converts to ~20GB/s
#   effective bandwidth with a 128B payload size" (S. Jeaugey, NCCL's maintainer, NVIDIA/nccl-tests
#   issue 149, 2023): 20 / 25.
# - network: "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (D. Addison, NVIDIA,
#   NVIDIA/nccl-tests issue 290, 2025): 47 / 50.
NVLINK_EFFICIENCY, NIC_EFFICIENCY = 20 / 25, 47 / 50
# Latencies: NCCL 2.28's tuning model (the version the book's GPU box ran, 2.28.9: src/graph/tuning.cc,
# ncclTunerConstantsDefaults, bulk "Simple" protocol): 8.4 us per collective call, 3.4 us per ring
# step over NVLink (4.0 us per tree step), 14 us per step over the network (ring and tree). They
# matter only for messages below a few megabytes. The same file scales the tree all-reduce's
# bandwidth by 0.92.
NCCL_BASE_LATENCY_S = 8.4e-6
NVLINK_ALPHA_S, NVLINK_TREE_ALPHA_S, NETWORK_ALPHA_S = 3.4e-6, 4.0e-6, 14e-6
TREE_BANDWIDTH_FACTOR = 0.92

# Links, line rates from the datasheets, one direction per GPU or per card:
# NVLink 4 on H100 SXM: 900 GB/s both directions (NVIDIA H100 datasheet); NVLink 3 on A100 SXM:
# 12 links of 25 GB/s; NVLink 2 on V100 SXM: 6 links of 25 GB/s (the ZeRO paper's "300GB/sec"
# counts both directions). NICs: 400 Gb/s NDR (DGX H100), 200 Gb/s HDR (DGX A100), 100 Gb/s EDR
# (DGX-2, the ZeRO paper's "12.5 GB/sec per link").
NVLINK4 = Link("NVLink 4 (H100)", 450e9, NVLINK_EFFICIENCY, NVLINK_ALPHA_S, NVLINK_TREE_ALPHA_S)
NVLINK3 = Link("NVLink 3 (A100)", 300e9, NVLINK_EFFICIENCY, NVLINK_ALPHA_S, NVLINK_TREE_ALPHA_S)
NVLINK2 = Link("NVLink 2 (V100)", 150e9, NVLINK_EFFICIENCY, NVLINK_ALPHA_S, NVLINK_TREE_ALPHA_S)
IB_NDR400 = Link("InfiniBand NDR 400 Gb/s", 50e9, NIC_EFFICIENCY, NETWORK_ALPHA_S)
IB_HDR200 = Link("InfiniBand HDR 200 Gb/s", 25e9, NIC_EFFICIENCY, NETWORK_ALPHA_S)
IB_EDR100 = Link("InfiniBand EDR 100 Gb/s", 12.5e9, NIC_EFFICIENCY, NETWORK_ALPHA_S)

# H100 = 989e12: the H100 SXM datasheet's dense bf16 Tensor Core peak (1,979 is with 2:4 sparsity).
H100_PEAK_FLOPS, A100_PEAK_FLOPS, V100_PEAK_FLOPS = 989e12, 312e12, 125e12

# DGX H100 (DGX H100 user guide): 8 H100 SXM on NVSwitch, eight 400 Gb/s ConnectX-7 cards.
# MFU 40%: Llama 3 405B pre-training on 8,192 to 16,384 H100s reports 38 to 43% ("The Llama 3
# Herd of Models", Table 4), all parallelisms and their communication included.
H100_CLUSTER = Cluster("DGX H100", gpus_per_node=8, nvlink=NVLINK4, nic=IB_NDR400, nics_per_node=8,
                       peak_flops=H100_PEAK_FLOPS, mfu=0.40)
# DGX A100: 8 A100 SXM on NVSwitch, eight 200 Gb/s HDR cards. No MFU figure is used for it here.
A100_CLUSTER = Cluster("DGX A100", gpus_per_node=8, nvlink=NVLINK3, nic=IB_HDR200, nics_per_node=8,
                       peak_flops=A100_PEAK_FLOPS, mfu=float("nan"))
# The ZeRO paper's cluster: 25 DGX-2 nodes of 16 V100s on NVSwitch, "800 Gbps internode" (eight
# 100 Gb/s EDR cards). Compute: 39 TFLOP/s, Megatron-LM's single-V100 baseline ("a strong single
# GPU baseline that sustains 39 TeraFLOPs", Shoeybi et al. 2019), of the V100's 125 peak.
V100_DGX2_CLUSTER = Cluster("DGX-2 (V100)", gpus_per_node=16, nvlink=NVLINK2, nic=IB_EDR100, nics_per_node=8,
                            peak_flops=V100_PEAK_FLOPS, mfu=39e12 / V100_PEAK_FLOPS)


def with_nics(cluster: Cluster, nics_per_node: int) -> Cluster:
    """The same cluster with fewer (or more) network cards per node: ZeRO++'s 4-card and 1-card runs."""
    return replace(cluster, name=f"{cluster.name}, {nics_per_node} NIC{'s' if nics_per_node > 1 else ''} per node",
                   nics_per_node=nics_per_node)


def delivered_bandwidths(cluster: Cluster) -> dict:
    """Bytes per second NCCL gets, one direction: each GPU's NVLink, one network card, and a node's
    cards together (what the chapters quote; the times themselves come from collective_cost)."""
    return {"nvlink": cluster.nvlink.bandwidth_Bps, "nic": cluster.nic.bandwidth_Bps, "node_network": cluster.network_Bps}


def assumption_rows(cluster: Cluster) -> list[tuple[str, str]]:
    """(what, value) for each hardware figure a cluster's estimates rest on, for the chapters' tables."""
    def link(lk: Link) -> str:
        return (f"{lk.name}: {lk.line_rate_Bps / 1e9:g} GB/s line rate x {lk.efficiency:.2f} = "
                f"{lk.bandwidth_Bps / 1e9:.0f} GB/s each way, {lk.alpha_s * 1e6:g} µs per ring step"
                + (f" ({lk.tree_alpha_s * 1e6:g} per tree step)" if lk.tree_alpha_s not in (None, lk.alpha_s) else ""))
    return [("GPUs per node", f"{cluster.gpus_per_node}"),
            ("each GPU's NVLink", link(cluster.nvlink)),
            ("each network card", link(cluster.nic)),
            ("network cards per node", f"{cluster.nics_per_node}: {cluster.network_Bps / 1e9:.0f} GB/s per node each way"),
            ("latency of a collective call", f"{cluster.base_latency_s * 1e6:g} µs"),
            ("compute", f"{cluster.peak_flops / 1e12:g} TFLOP/s peak at {cluster.mfu:.0%} MFU = "
                        f"{cluster.achieved_flops / 1e12:.1f} TFLOP/s per GPU")]


# ------------------------------------------------------------------ bytes of one collective
def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; choose one of {KINDS}")


def ring_steps(kind: str, n: int) -> int:
    """Latency-bound steps of the ring: N-1, or 2(N-1) for an all-reduce (all-to-all: N-1 pairs)."""
    _check_kind(kind)
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def wire_factor(kind: str, n: int) -> float:
    """Bytes one rank sends, as a fraction of the full tensor S: (N-1)/N, twice for all-reduce.

    For an all-to-all S is one rank's whole send buffer, of which it keeps 1/N."""
    return ring_steps(kind, n) / n


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends; nbytes is S, the FULL (unsharded) tensor."""
    return wire_factor(kind, n) * nbytes


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """S / t: how fast the tensor itself was processed (nccl-tests' "algbw")."""
    return nbytes / seconds


def bus_bandwidth(kind: str, nbytes: float, n: int, seconds: float) -> float:
    """The algorithm bandwidth times the ring's wire factor (nccl-tests' "busbw").

    2(N-1)/N for all-reduce, (N-1)/N for reduce-scatter and all-gather, as defined in
    NVIDIA/nccl-tests doc/PERFORMANCE.md: the bytes each rank moved per second, which can be
    compared with the link's bandwidth whatever N is.
    """
    return algorithm_bandwidth(nbytes, seconds) * wire_factor(kind, n)


# ------------------------------------------------------------------ time of one collective
@dataclass(frozen=True)
class Cost:
    """One collective on one group, as the model sees it.

    nvlink_bytes: what ONE GPU sends over its NVLink; network_bytes: what ONE node sends to the
    network for this group (the sum over its ranks in the group). nvlink_s and network_s: those
    bytes over the bandwidth they get. The two links work at the same time.
    """

    kind: str
    algorithm: str
    latency_s: float
    nvlink_bytes: float
    network_bytes: float
    nvlink_s: float
    network_s: float

    @property
    def bandwidth_s(self) -> float:
        return max(self.nvlink_s, self.network_s)

    @property
    def seconds(self) -> float:
        return self.latency_s + self.bandwidth_s

    @property
    def bound_by(self) -> str:
        """'network', 'NVLink' or 'latency': the largest of the three terms."""
        return max((self.network_s, "network"), (self.nvlink_s, "NVLink"), (self.latency_s, "latency"))[1]


def _layout(n: int, cluster: Cluster, ranks_per_node: int | None) -> tuple[int, int]:
    """(ranks of the group per node, nodes): packed into full nodes unless told otherwise."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    r = min(n, cluster.gpus_per_node) if ranks_per_node is None else ranks_per_node
    if not 1 <= r <= cluster.gpus_per_node or n % r:
        raise ValueError(f"ranks_per_node={r} must divide n={n} and be at most {cluster.gpus_per_node}")
    return r, n // r


def _latency(kind: str, algorithm: str, n: int, r: int, nodes: int, cluster: Cluster) -> float:
    """NCCL's latency model (tuning.cc): a fixed cost per call plus one per step, the network's
    for the steps that cross nodes and NVLink's for the others (the tree's own per-step values)."""
    a_nv, a_net = cluster.nvlink.alpha_s, cluster.nic.alpha_s
    if kind == "all_to_all":                   # every pair at once: one step, over the slowest link
        return cluster.base_latency_s + (a_net if nodes > 1 else a_nv)
    if algorithm == "tree":                    # up the tree and down: a chain in the node, log2 across
        tree_nv = cluster.nvlink.tree_alpha_s or a_nv
        tree_net = cluster.nic.tree_alpha_s or a_net
        return cluster.base_latency_s + 2 * ((r - 1) * tree_nv + int(math.log2(nodes)) * tree_net)
    steps = ring_steps(kind, n)
    crossing = 0 if nodes == 1 else (2 * (nodes - 1) if kind == "all_reduce" else nodes - 1)
    return cluster.base_latency_s + (steps - crossing) * a_nv + crossing * a_net


def collective_cost(kind: str, nbytes: float, n: int, cluster: Cluster, *, ranks_per_node: int | None = None,
                    algorithm: str = "auto") -> Cost:
    """Latency and bandwidth terms of one collective of S = nbytes over n ranks.

    ranks_per_node: how many of the group's ranks share a node (default: packed, min(n, gpus per
    node)). A group with fewer ranks per node than the node's GPUs shares the node's network
    cards with the other groups like it that run at the same time (HSDP's and hpZ's groups do):
    it gets ranks_per_node / gpus_per_node of them.
    algorithm: "ring", "tree" (all-reduce only) or "auto", the faster of the two as NCCL picks.
    """
    _check_kind(kind)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    r, nodes = _layout(n, cluster, ranks_per_node)
    if n == 1:
        return Cost(kind, "none", 0.0, 0.0, 0.0, 0.0, 0.0)
    if algorithm == "auto":
        choices = ("ring", "tree") if kind == "all_reduce" and nodes > 1 else ("ring",)
        return min((collective_cost(kind, nbytes, n, cluster, ranks_per_node=r, algorithm=a) for a in choices),
                   key=lambda c: c.seconds)
    if algorithm == "tree" and kind != "all_reduce":
        raise ValueError("NCCL's tree algorithm is an all-reduce; reduce-scatter and all-gather use rings")
    sent = wire_bytes(kind, nbytes, n)                       # per rank
    if nodes == 1:
        nvlink_bytes, network_bytes = sent, 0.0
    elif kind == "all_to_all":                               # each peer gets its own piece
        nvlink_bytes = (r - 1) / n * nbytes
        network_bytes = r * (n - r) / n * nbytes
    else:                                                    # each ring leaves the node once
        nvlink_bytes = (r - 1) / r * sent
        network_bytes = sent
    network_share = cluster.network_Bps * r / cluster.gpus_per_node
    slow = 1 / TREE_BANDWIDTH_FACTOR if algorithm == "tree" else 1.0     # tuning.cc: the tree's busBw * 0.92
    return Cost(kind, algorithm, _latency(kind, algorithm, n, r, nodes, cluster), nvlink_bytes, network_bytes,
                slow * nvlink_bytes / cluster.nvlink.bandwidth_Bps, slow * network_bytes / network_share)


def collective_seconds(kind: str, nbytes: float, n: int, cluster: Cluster, *, ranks_per_node: int | None = None,
                       algorithm: str = "auto") -> float:
    """Seconds of one collective: latency + the slower of the NVLink and network terms."""
    return collective_cost(kind, nbytes, n, cluster, ranks_per_node=ranks_per_node, algorithm=algorithm).seconds


def ring_bus_bandwidth(n: int, cluster: Cluster, ranks_per_node: int | None = None) -> float:
    """The bus bandwidth a ring reaches for large messages (latency negligible): the NVLink's
    inside one node; across nodes the smaller of the node's network share and NVLink's rate
    scaled up by r/(r-1) (each GPU sends only (r-1)/r of its bytes over NVLink)."""
    r, nodes = _layout(n, cluster, ranks_per_node)
    if nodes == 1:
        return cluster.nvlink.bandwidth_Bps
    network = cluster.network_Bps * r / cluster.gpus_per_node
    return network if r == 1 else min(network, cluster.nvlink.bandwidth_Bps * r / (r - 1))


# ------------------------------------------------------------------ one training step
@dataclass(frozen=True)
class StepEstimate:
    """Seconds of one step on one rank.

    compute_s: forward + backward arithmetic at the cluster's achieved FLOP/s.
    comm_s: the step's collectives, back to back, if nothing overlapped them.
    exposed_s: the communication compute cannot hide (a lower bound; see step_estimate).
    """

    compute_s: float
    comm_s: float
    exposed_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def hidden_fraction(self) -> float:
        """Share of the communication that overlaps compute (1.0 when there is none to hide)."""
        return 1.0 if self.comm_s == 0 else 1.0 - self.exposed_s / self.comm_s


# fraction of a step's FLOPs in each pass: backward costs about twice the forward (a gradient
# for the input and one for the weight per matmul), hence 2 + 4 = 6 FLOPs per parameter per token
FORWARD_SHARE, BACKWARD_SHARE = 1 / 3, 2 / 3


@dataclass(frozen=True)
class Collective:
    """One collective of a step: kind, S (nbytes, the full tensor), its group (n ranks,
    ranks_per_node of them per node: None packs them into full nodes) and the pass it can overlap
    ("forward", "backward", or "after_step", where no compute is left to hide it)."""

    kind: str
    nbytes: float
    n: int
    phase: str
    ranks_per_node: int | None = None

    def cost(self, cluster: Cluster) -> Cost:
        return collective_cost(self.kind, self.nbytes, self.n, cluster, ranks_per_node=self.ranks_per_node)


PHASES = ("forward", "backward", "after_step")


def step_collectives(stage: int, psi: float, n: int, bytes_per_element: float = 2) -> list:
    """The collectives of one data-parallel step over n ranks.

    stage 0 (DDP): the gradients are all-reduced during backward, bucket by bucket.
    stages 1 and 2: the same bytes split in two (ZeRO paper, section 7): the gradients are
        reduce-scattered during backward, and the updated parameters all-gathered after the
        optimizer step, where no compute is left to hide them ("after_step"): so do zerolab
        and DeepSpeed. (PyTorch FSDP's SHARD_GRAD_OP gathers in the next forward instead,
        where it can overlap.)
    stage 3: parameters are all-gathered before each unit's forward and again before its
        backward, and gradients reduce-scattered during backward: 3 Psi instead of 2 Psi.
    """
    s = psi * bytes_per_element
    if stage == 0:
        return [Collective("all_reduce", s, n, "backward")]
    if stage in (1, 2):
        return [Collective("reduce_scatter", s, n, "backward"), Collective("all_gather", s, n, "after_step")]
    if stage == 3:
        return [Collective("all_gather", s, n, "forward"), Collective("all_gather", s, n, "backward"),
                Collective("reduce_scatter", s, n, "backward")]
    raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage}")


def busy_by_phase(collectives, cluster: Cluster) -> dict:
    """Seconds of communication in each pass: the collectives of a pass run one after another."""
    busy = dict.fromkeys(PHASES, 0.0)
    for c in collectives:
        busy[c.phase] += c.cost(cluster).seconds
    return busy


def compute_seconds(psi: float, tokens_per_rank: float, cluster: Cluster) -> float:
    """6 * psi * tokens at the cluster's achieved FLOP/s: the usual count for a dense transformer
    (attention's extra FLOPs and activation recomputation are left out, as MFU leaves them out). psi
    includes the embedding tables, which are looked up rather than multiplied: a few percent more
    FLOPs than the book's GPU tables count (zerolab.book.mfu), about 3% for a 7.5B model."""
    return 6 * psi * tokens_per_rank / cluster.achieved_flops


def estimate(collectives, compute_s: float, cluster: Cluster, overlap: bool = True) -> StepEstimate:
    """Compute, communication and exposed communication of a step with these collectives.

    With overlap, each pass hides at most its own compute time: collectives tied to the forward
    overlap the forward (a third of the compute), those tied to the backward overlap the
    backward (two thirds); what runs after the optimizer step is exposed whole. This is a lower
    bound: the last bucket's all-reduce and the first unit's all-gather cannot overlap anything,
    and overlapped NCCL kernels slow the compute beside them. overlap=False gives the upper
    bound: nothing hidden.
    """
    busy = busy_by_phase(collectives, cluster)
    comm = sum(busy.values())
    if not overlap:
        return StepEstimate(compute_s=compute_s, comm_s=comm, exposed_s=comm)
    budget = {"forward": FORWARD_SHARE * compute_s, "backward": BACKWARD_SHARE * compute_s, "after_step": 0.0}
    exposed = sum(max(0.0, busy[phase] - budget[phase]) for phase in PHASES)
    return StepEstimate(compute_s=compute_s, comm_s=comm, exposed_s=exposed)


def step_estimate(stage: int, psi: float, n: int, tokens_per_rank: float, cluster: Cluster,
                  bytes_per_element: float = 2, *, overlap: bool = True) -> StepEstimate:
    """One data-parallel step of a psi-parameter model on n GPUs: estimate() of step_collectives,
    with bytes_per_element for the communicated gradients and parameters (2: bf16)."""
    return estimate(step_collectives(stage, psi, n, bytes_per_element),
                    compute_seconds(psi, tokens_per_rank, cluster), cluster, overlap)


def min_tokens_to_hide(stage: int, psi: float, n: int, cluster: Cluster, bytes_per_element: float = 2) -> float:
    """Tokens per rank per step above which the overlappable communication is fully hidden.

    Compute grows with the tokens, communication does not: solve busy[phase] = share * compute
    for the binding pass. The all-gather after a ZeRO-1/2 step is never hidden, whatever the
    batch; it is left out here.
    """
    per_token = compute_seconds(psi, 1, cluster)
    busy = busy_by_phase(step_collectives(stage, psi, n, bytes_per_element), cluster)
    share = {"forward": FORWARD_SHARE, "backward": BACKWARD_SHARE}
    return max(busy[p] / (share[p] * per_token) for p in share)


def hide_threshold_tokens(n: int, cluster: Cluster, bytes_per_element: float = 2) -> float:
    """min_tokens_to_hide without latency, in closed form: T = (N-1)/N * F * c / (2 beta).

    A ring collective of the 2-byte parameters sends (N-1)/N * 2 Psi bytes at the bus bandwidth beta
    (ring_bus_bandwidth); the forward computes 2 Psi FLOPs per token (a third of 6 Psi) at F. They
    are equal at this T, whatever Psi. The backward has twice the bytes against twice the compute,
    the same T; and so does DDP's all-reduce against the backward.
    """
    return (n - 1) / n * cluster.achieved_flops * bytes_per_element / (2 * ring_bus_bandwidth(n, cluster))
