"""A training step on a roofline: compute, memory bandwidth and the network in one notation.

The notation of the JAX scaling book (Austin et al., "How to Scale Your Model", 2025): an operation that
does C FLOPs and moves S_HBM bytes to and from the GPU's memory takes at least (the book's notation.md)

    t_math = C / F_peak        F_peak: the chip's FLOP/s (989e12 dense bf16 on an H100 SXM)
    t_mem  = S_HBM / beta_HBM  beta_HBM: its memory bandwidth (3.35e12 bytes/s of HBM3 on an H100 SXM)
    t_comm = S / beta          beta: a link's bandwidth for the S bytes a collective sends (zerolab.theory.cost_model)

and, overlapped perfectly, max of them. An operation is compute-bound when its arithmetic intensity C / S_HBM
exceeds F_peak / beta_HBM, about 295 FLOPs per byte on an H100; a matrix product of a (T x d_0) activation by a
(d_0 x d_1) weight has an intensity of about T, the tokens it multiplies, so the matrix products of training are
compute-bound and LayerNorm, GELU, softmax and the optimizer's update (a few FLOPs per byte) are
memory-bound. A step is the sum of its operations, each at its own roof:

    t_step >= sum over operations of max(C_op / (eta F_peak), S_HBM,op / beta_HBM)  (+ the communication not hidden)

with eta the share of F_peak a large matrix product reaches (a measured number: about 0.77 for bf16 on the
book's H100). MFU, the model's FLOPs per second over F_peak, is then at most model_flops / (F_peak t_step).

`count_step` counts C and M op by op for one training step of a model on the meta device (shapes only,
no arithmetic: a 7B model costs nothing to count), under a TorchDispatchMode; scaled-dot-product
attention is counted as one fused kernel, as FlashAttention runs it on a GPU (Q, K, V and the output
cross the memory once; the T x T scores never do). `step_time` puts the counts on a roofline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

# H100 SXM datasheet: 989 TFLOP/s dense bf16 (1,979 with 2:4 sparsity), 3.35 TB/s of HBM3.
H100_PEAK_FLOPS, H100_HBM_BPS = 989e12, 3.35e12
KINDS = ("matmul", "attention", "memory", "optimizer")
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "zeros_like",
         "detach", "alias", "_to_copy_meta"}


@dataclass
class Counts:
    """FLOPs and bytes of one step, by kind of operation; ops: (kind, name, flops, bytes) per operation."""

    ops: list = field(default_factory=list)

    def add(self, kind, name, flops, nbytes):
        self.ops.append((kind, name, float(flops), float(nbytes)))

    def total(self, kind=None, what="flops"):
        i = 2 if what == "flops" else 3
        return sum(op[i] for op in self.ops if kind is None or op[0] == kind)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class _Counter(TorchDispatchMode):
    """Every ATen operation below autograd: matrix products by their FLOPs (torch's own formulas) and
    bytes; the rest by the bytes they read and write. Views and allocations move nothing."""

    def __init__(self, counts: Counts):
        super().__init__()
        self.counts, self.kind, self.quiet = counts, "memory", False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self.quiet or func.is_view or name in _FREE:
            return out
        ins, _ = tree_flatten((args, kwargs))
        outs, _ = tree_flatten(out)
        written = []                               # arguments the op writes in place: read and written
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += tree_flatten(args[i] if i < len(args) else kwargs.get(arg.name))[0]
        fresh = [o for o in outs if isinstance(o, torch.Tensor) and not any(o is i for i in ins)]
        nbytes = _bytes(ins) + _bytes(written) + _bytes(fresh)
        if func.overloadpacket in flop_registry:
            self.counts.add("matmul", name, flop_registry[func.overloadpacket](*args, **kwargs, out_val=out), nbytes)
        else:
            self.counts.add(self.kind, name, 0, nbytes)
        return out


class _FusedAttention(torch.autograd.Function):
    """Causal attention as one fused kernel would run it: the FLOPs of QK^T and PV (counted in full, as the
    literature's MFU counts them), twice that in backward; Q, K, V and the output (and the per-row softmax
    statistics) cross the memory once each way, the T x T scores never."""

    @staticmethod
    def forward(ctx, q, k, v, counter):
        ctx.counter = counter
        ctx.save_for_backward(q, k, v)
        b, h, t, d = q.shape
        out = torch.empty_like(q)
        counter.counts.add("attention", "attention forward", 4 * b * h * t * t * d,
                           _bytes((q, k, v, out)) + b * h * t * 4)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        b, h, t, d = q.shape
        ctx.counter.counts.add("attention", "attention backward", 8 * b * h * t * t * d,
                               2 * _bytes((q, k, v, grad)) + b * h * t * 4)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class _FuseAttention(TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            self.counter.quiet = True            # its inner allocations are the fused kernel's own
            try:
                return _FusedAttention.apply(q, k, v, self.counter)
            finally:
                self.counter.quiet = False
        return func(*args, **(kwargs or {}))


def count_step(model: torch.nn.Module, loss_fn, batch, optimizer_factory=None, grad_dtype=torch.float32) -> Counts:
    """C and M of one training step: loss_fn(model, batch) forward, its backward, and, with
    optimizer_factory, one step of it on fp32 master copies of the parameters (the gradients cast to
    grad_dtype first, and the updated masters cast back to the parameters' dtype, as mixed precision does).
    Build the model and the batch on the meta device to count for free."""
    counts = Counts()
    counter = _Counter(counts)
    with _FuseAttention(counter), counter:
        loss = loss_fn(model, batch)
        loss.backward()
        if optimizer_factory is not None:
            counter.kind, counter.quiet = "optimizer", True
            params = [p for p in model.parameters() if p.grad is not None]
            masters = [p.detach().to(torch.float32).requires_grad_() for p in params]
            for m, p in zip(masters, params):
                m.grad = p.grad.to(grad_dtype)
            optimizer = optimizer_factory(masters)
            optimizer.step()                       # the first step creates the optimizer's state: not counted
            counter.quiet = False
            for m, p in zip(masters, params):      # a step: cast the gradients, update, cast the masters back
                m.grad = p.grad.to(grad_dtype)
            optimizer.step()
            for m, p in zip(masters, params):
                p.data.copy_(m.data)
    return counts


@dataclass(frozen=True)
class Roof:
    """A chip's roof: peak FLOP/s, memory bandwidth, and the share of the peak a large matrix product reaches."""

    name: str
    peak_flops: float
    hbm_Bps: float
    matmul_efficiency: float = 1.0

    @property
    def critical_intensity(self) -> float:
        """FLOPs per byte above which an operation is compute-bound: F_peak / beta_HBM."""
        return self.peak_flops / self.hbm_Bps


H100_SXM = Roof("H100 SXM (datasheet)", H100_PEAK_FLOPS, H100_HBM_BPS)


def step_time(counts: Counts, roof: Roof, optimizer_share: float = 1.0) -> dict:
    """Seconds of each kind of operation, each operation at its own roof max(C / (e F), M / B), and the
    total; memory_bound: the part of it set by the memory bandwidth. optimizer_share: the part of the
    optimizer's update this GPU runs (1/N under ZeRO, whose ranks each update 1/N of the parameters)."""
    out = dict.fromkeys(KINDS, 0.0)
    memory_bound = 0.0
    for kind, _, flops, nbytes in counts.ops:
        share = optimizer_share if kind == "optimizer" else 1.0
        t_math, t_mem = share * flops / (roof.matmul_efficiency * roof.peak_flops), share * nbytes / roof.hbm_Bps
        out[kind] += max(t_math, t_mem)
        memory_bound += t_mem if t_mem > t_math else 0.0
    out["total"] = sum(out[k] for k in KINDS)
    out["memory_bound"] = memory_bound
    return out


def mfu_bound(model_flops: float, counts: Counts, roof: Roof, optimizer_share: float = 1.0,
              exposed_comm_s: float = 0.0) -> float:
    """The highest MFU the roofline allows: the model's FLOPs over the peak, in the step's roofline time
    (plus the communication that stays exposed)."""
    t = step_time(counts, roof, optimizer_share)["total"] + exposed_comm_s
    return model_flops / (roof.peak_flops * t)
