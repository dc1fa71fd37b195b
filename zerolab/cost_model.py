"""A cost model for collectives and for one data-parallel training step, on paper.

The book's runs use gloo on a laptop CPU, whose timings say little about a GPU cluster. This
module answers the cluster questions with arithmetic instead: how long does an all-reduce of
S bytes take on N GPUs, and when does a training step hide it behind compute?

    from zerolab import cost_model as cm
    cm.collective_seconds("all_reduce", 2 * 7e9, 8, cm.H100_CLUSTER.intra)   # 7B bf16 grads, one node
    cm.step_estimate(stage=3, psi=7e9, n=64, tokens_per_rank=8 * 4096, cluster=cm.H100_CLUSTER)

Three layers, each a few lines:

1. The alpha-beta model of one message (Hockney): sending m bytes over a link costs
   alpha + m / beta seconds, alpha a fixed latency, beta the link's bandwidth.
2. The ring algorithm built from it (chapter 4): N ranks pass chunks of S/N bytes around a
   ring. A reduce-scatter or an all-gather takes N-1 steps and each rank sends (N-1)/N * S
   bytes; an all-reduce is the two in a row, 2(N-1) steps and 2(N-1)/N * S bytes. All ranks send
   at once, so the time is the steps' latency plus one rank's bytes over one rank's bandwidth.
3. A training step: compute from the 6 * params * tokens rule, communication from the ZeRO
   paper's volumes (2 Psi for DDP, ZeRO-1 and ZeRO-2; 3 Psi for ZeRO-3), and the part of the
   communication that the compute cannot hide.

What the model leaves out, on purpose (each makes the estimate optimistic; a measurement on
real hardware is the judge):
- NCCL picks among several algorithms (ring, tree, NVLS on NVSwitch, CollNet) and protocols per
  call; only the ring is modelled here. Its bytes per rank are the least any algorithm can send,
  so the bandwidth term is a floor.
- Links never reach their peak: NCCL's benchmarks measure bus bandwidths somewhat below the
  datasheet's figure. A Link takes whatever bandwidth you give it; the preset uses the peak.
- A ring that spans nodes is limited by its slowest hop, so every step is charged the
  inter-node link (NCCL's own model charges only the node-crossing steps the network latency).
- Communication that overlaps compute is not free on a GPU: NCCL's kernels occupy streaming
  multiprocessors and memory bandwidth, so the compute next to them runs slower.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class Link:
    """One kind of connection between GPUs, as seen by one rank.

    alpha_s: seconds of latency per message step (the fixed cost of one hop of the ring).
    bandwidth_Bps: bytes per second that one rank can send in ONE direction while it receives
        as much in the other (datasheets often quote the two directions added together).
    """

    name: str
    alpha_s: float
    bandwidth_Bps: float


@dataclass(frozen=True)
class Cluster:
    """Nodes of gpus_per_node GPUs: `intra` connects GPUs of one node, `inter` crosses nodes.

    peak_flops: one GPU's dense peak for the training dtype (FLOP/s).
    mfu: the fraction of that peak a real training run achieves (model FLOPs utilisation).
    """

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link
    peak_flops: float
    mfu: float

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.mfu


# An H100 SXM cluster like NVIDIA's DGX H100. Every figure is an assumption, with its source:
# - 8 GPUs per node, joined by NVLink 4 through NVSwitch: 900 GB/s per GPU, both directions
#   together, so 450 GB/s each way (NVIDIA H100 Tensor Core GPU datasheet; DGX H100 user guide).
# - one 400 Gb/s NDR InfiniBand port (ConnectX-7) per GPU for the cluster network: 400 / 8 =
#   50 GB/s each way (DGX H100 user guide: eight single-port ConnectX-7 cards, up to 400 Gb/s).
# - latency per ring step: NCCL's own tuning model (src/graph/tuning.cc) charges a ring step of
#   its bulk ("Simple") protocol about 3.4 us over NVLink and 9.6 us over the network; we round
#   to 3 us and 10 us. They matter only for small messages (below about a megabyte).
# - bf16 dense Tensor Core peak 989 TFLOP/s (the datasheet's 1,979 is with 2:4 sparsity).
# - 40% of that peak achieved: large dense-transformer runs on H100 report 38-43% model FLOPs
#   utilisation in bf16 (Llama 3, "The Llama 3 Herd of Models", Table 4).
NVLINK4 = Link("NVLink 4 (intra-node)", alpha_s=3e-6, bandwidth_Bps=450e9)
IB_NDR400 = Link("InfiniBand NDR 400 Gb/s (inter-node)", alpha_s=10e-6, bandwidth_Bps=50e9)
H100_CLUSTER = Cluster("8x H100 SXM nodes", gpus_per_node=8, intra=NVLINK4, inter=IB_NDR400,
                       peak_flops=989e12, mfu=0.4)


# ------------------------------------------------------------------ collectives (ring, alpha-beta)
def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; choose one of {KINDS}")


def ring_steps(kind: str, n: int) -> int:
    """Latency-bound steps of the ring: N-1, or 2(N-1) for an all-reduce."""
    _check_kind(kind)
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def wire_factor(kind: str, n: int) -> float:
    """Bytes one rank sends, as a fraction of the full tensor S: (N-1)/N, twice for all-reduce."""
    _check_kind(kind)
    return ring_steps(kind, n) / n


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in the ring algorithm; nbytes is S, the FULL (unsharded) tensor."""
    return wire_factor(kind, n) * nbytes


def collective_seconds(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Time of one ring collective over `link`: steps * alpha + per-rank wire bytes / bandwidth.

    Each step sends S/N bytes; charging alpha per step and the bytes at the link's bandwidth is
    the alpha-beta model applied to the ring. One rank (n == 1) moves nothing and takes no time.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if n == 1:
        _check_kind(kind)
        return 0.0
    return ring_steps(kind, n) * link.alpha_s + wire_bytes(kind, nbytes, n) / link.bandwidth_Bps


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """S / t: how fast the tensor itself was processed (nccl-tests' "algbw")."""
    return nbytes / seconds


def bus_bandwidth(kind: str, nbytes: float, n: int, seconds: float) -> float:
    """The algorithm bandwidth times the ring's wire factor (nccl-tests' "busbw").

    2(N-1)/N for all-reduce, (N-1)/N for reduce-scatter and all-gather, as defined in
    NVIDIA/nccl-tests doc/PERFORMANCE.md: the bytes each rank really moved per second, which
    can be compared with the link's bandwidth whatever N is.
    """
    return algorithm_bandwidth(nbytes, seconds) * wire_factor(kind, n)


def bottleneck_link(n: int, cluster: Cluster) -> Link:
    """The link a ring of n GPUs is limited by: NVLink within one node, the network beyond.

    A flat ring over several nodes goes as fast as its slowest hop, the one between nodes.
    (NCCL runs one ring per NIC in parallel, so each GPU's share of the network is its own NIC:
    the per-rank inter-node bandwidth is one NIC's.)
    """
    return cluster.intra if n <= cluster.gpus_per_node else cluster.inter


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


def step_collectives(stage: int, psi: float, bytes_per_element: int = 2) -> list:
    """The collectives of one step as (kind, full-tensor bytes, pass it can overlap with).

    stage 0 (DDP): the gradients are all-reduced during backward, bucket by bucket.
    stages 1 and 2: the same bytes split in two (ZeRO paper, section 7): the gradients are
        reduce-scattered during backward, and the updated parameters all-gathered after the
        optimizer step, where no compute is left to hide them ("after_step"): so do zerolab
        and DeepSpeed. (PyTorch FSDP's SHARD_GRAD_OP gathers in the next forward instead,
        where it can overlap: count it as "forward" to model that.)
    stage 3: parameters are all-gathered before each unit's forward and again before its
        backward, and gradients reduce-scattered during backward: 3 Psi instead of 2 Psi.
    """
    s = psi * bytes_per_element
    if stage == 0:
        return [("all_reduce", s, "backward")]
    if stage in (1, 2):
        return [("reduce_scatter", s, "backward"), ("all_gather", s, "after_step")]
    if stage == 3:
        return [("all_gather", s, "forward"), ("all_gather", s, "backward"),
                ("reduce_scatter", s, "backward")]
    raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage}")


def step_estimate(stage: int, psi: float, n: int, tokens_per_rank: float, cluster: Cluster,
                  bytes_per_element: int = 2) -> StepEstimate:
    """Compute, communication and exposed communication of one step of a psi-parameter model.

    compute_s = 6 * psi * tokens_per_rank / (peak_flops * mfu): the usual count for a dense
    transformer (attention's extra FLOPs and activation recomputation are left out).

    comm_s: the step's collectives (step_collectives) over the ring's bottleneck link, with
    bytes_per_element for the communicated gradients and parameters (2: bf16).

    exposed_s: each pass hides at most its own compute time: collectives tied to the forward
    overlap the forward (a third of the compute), those tied to the backward overlap the
    backward (two thirds); the all-gather after the optimizer step is exposed whole. This is a
    lower bound: the last bucket's all-reduce and the first unit's all-gather cannot overlap
    anything, and overlapped NCCL kernels slow the compute beside them (they take SMs and
    memory bandwidth).
    """
    compute = 6 * psi * tokens_per_rank / cluster.achieved_flops
    link = bottleneck_link(n, cluster)
    budget = {"forward": FORWARD_SHARE * compute, "backward": BACKWARD_SHARE * compute,
              "after_step": 0.0}
    busy = {phase: 0.0 for phase in budget}
    for kind, nbytes, phase in step_collectives(stage, psi, bytes_per_element):
        busy[phase] += collective_seconds(kind, nbytes, n, link)
    comm = sum(busy.values())
    exposed = sum(max(0.0, busy[phase] - budget[phase]) for phase in budget)
    return StepEstimate(compute_s=compute, comm_s=comm, exposed_s=exposed)


def min_tokens_to_hide(stage: int, psi: float, n: int, cluster: Cluster,
                       bytes_per_element: int = 2) -> float:
    """Tokens per rank per step above which the overlappable communication is fully hidden.

    Compute grows with the tokens, communication does not: solve busy[phase] = share * compute
    for the binding pass. The all-gather after a ZeRO-1/2 step is never hidden, whatever the
    batch; it is left out here.
    """
    per_token = 6 * psi / cluster.achieved_flops           # compute seconds per token
    link = bottleneck_link(n, cluster)
    busy = {"forward": 0.0, "backward": 0.0}
    for kind, nbytes, phase in step_collectives(stage, psi, bytes_per_element):
        if phase in busy:
            busy[phase] += collective_seconds(kind, nbytes, n, link)
    share = {"forward": FORWARD_SHARE, "backward": BACKWARD_SHARE}
    return max(busy[p] / (share[p] * per_token) for p in busy)
