"""Flat, padded, contiguous buckets: the memory layout every zerolab engine shares.

Communicating one small tensor at a time wastes time on per-message latency, so engines
group parameters into buckets of about `bucket_bytes`, and give each bucket ONE flat buffer:

    bucket.data   [ p3 | p2 | p1 | pad ]    every parameter's .data is a view into it
    bucket.grad   [ g3 | g2 | g1 | pad ]    every parameter's .grad is a view into it

so a whole bucket is reduced with one collective and no copies. Three choices:

* Buckets follow the REVERSE of the forward order (approximated, as PyTorch DDP does, by the
  reverse of model.parameters()): backward produces the last layer's gradients first, so the
  first bucket fills first and its communication can start while backward goes on.
* Each buffer is padded with zeros to a multiple of the world size, so it splits into N
  equal contiguous shards: rank r owns `bucket.shard(r)`. ZeRO keeps its fp32 master copy
  and optimizer state for that shard only, and reduce-scatter / all-gather need no copies.
* A tied weight is one tensor, so it appears once (model.parameters() deduplicates it).

The optimizer does not see these flat buffers: it is handed one view per parameter of the
slice each rank updates (zerolab.optim.param_views), so it works parameter by parameter, as
PyTorch's optimizers do, while the collectives move whole buckets.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Piece(NamedTuple):
    """The part of one parameter that lies in a slice of a flat buffer: buffer elements
    [start, stop), empty (start == stop) when none of it does."""
    param: torch.Tensor
    offset: int                 # where the parameter begins in the buffer
    numel: int
    start: int
    stop: int
    slice_start: int            # where the slice begins in the buffer

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.size == self.numel

    @property
    def in_slice(self) -> tuple:
        """(lo, hi): where the piece lies in the slice."""
        return self.start - self.slice_start, self.stop - self.slice_start

    @property
    def in_param(self) -> tuple:
        """(lo, hi): which elements of the flattened parameter the piece holds."""
        return self.start - self.offset, self.stop - self.offset


class Bucket:
    """A group of parameters that live in one flat buffer (and their gradients in another)."""

    def __init__(self, index: int, params, world_size: int, quantum: int | None = None):
        self.index = index
        self.params = list(params)
        self.world_size = world_size
        self.sizes = [p.numel() for p in self.params]
        self.offsets = []
        total = 0
        for n in self.sizes:
            self.offsets.append(total)
            total += n
        self.numel = total                                         # real elements
        # a multiple of N; `quantum` (a multiple of N) pads further: the bitwise mode's N * block,
        # so that every shard starts on the same alignment (zerolab.bitwise.buckets.quantum)
        q = world_size if quantum is None else quantum
        if q % world_size:
            raise ValueError(f"Bucket: quantum ({q}) must be a multiple of the world size ({world_size})")
        self.padded_numel = -(-total // q) * q
        self.data: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self._grad_views: list = []

    def views(self, flat: torch.Tensor) -> list:
        """Per-parameter views into a flat buffer with this bucket's layout."""
        return [flat[o:o + n].view(p.shape) for p, o, n in zip(self.params, self.offsets, self.sizes)]

    def shard(self, rank: int) -> slice:
        """The contiguous slice of the padded buffer that rank `rank` owns."""
        size = self.padded_numel // self.world_size
        return slice(rank * size, (rank + 1) * size)

    def piece(self, i: int, part: slice) -> Piece:
        """Where parameter i meets slice `part` of the buffer (a shard). An empty piece sits at
        the slice's edge nearest the parameter, so its place in the slice is still valid."""
        o, n = self.offsets[i], self.sizes[i]
        lo, hi = max(o, part.start), min(o + n, part.stop)
        if lo >= hi:
            lo = hi = max(min(o, part.stop), part.start)
        return Piece(self.params[i], o, n, lo, hi, part.start)

    def pieces(self, part: slice) -> list:
        """Where every parameter meets slice `part` of the buffer, in the bucket's order."""
        return [self.piece(i, part) for i in range(len(self.params))]

    def flat_copy(self, dtype=None) -> torch.Tensor:
        """A new padded flat buffer holding the parameters' current values (padding = 0)."""
        p0 = self.params[0]
        flat = torch.zeros(self.padded_numel, dtype=dtype or p0.dtype, device=p0.device)
        with torch.no_grad():
            for view, p in zip(self.views(flat), self.params):
                view.copy_(p.detach())
        return flat

    def bind_params(self) -> None:
        """Move the parameters into one flat buffer: afterwards each p.data is a view into it."""
        self.data = self.flat_copy()
        for view, p in zip(self.views(self.data), self.params):
            p.data = view

    def bind_grads(self, dtype=None, out: torch.Tensor | None = None) -> None:
        """Allocate the flat gradient buffer (or use `out`) and make each p.grad a view into it."""
        if out is not None and (out.dim() != 1 or out.numel() != self.padded_numel):
            raise ValueError(f"bind_grads: out must be a flat tensor of {self.padded_numel} elements")
        self.grad = out if out is not None else torch.zeros(
            self.padded_numel, dtype=dtype or self.params[0].dtype, device=self.params[0].device)
        self._grad_views = self.views(self.grad)
        self.attach_grads()

    def attach_grads(self) -> None:
        """(Re)point every p.grad at its view of the flat gradient buffer."""
        for view, p in zip(self._grad_views, self.params):
            p.grad = view

    def release_grads(self) -> None:
        """Free the flat gradient buffer (bind_grads allocates a new one); p.grad is untouched."""
        self.grad, self._grad_views = None, []

    def grad_view(self, position: int) -> torch.Tensor:
        return self._grad_views[position]

    def __repr__(self):
        return (f"Bucket({self.index}, params={len(self.params)}, numel={self.numel}, "
                f"padded={self.padded_numel})")


def bucket_order(model: torch.nn.Module) -> list:
    """Trainable parameters in reverse forward order (each tied weight once)."""
    return [p for p in model.parameters() if p.requires_grad][::-1]


class FlatBuckets:
    """Split `params` (already in bucket order) into buckets of at most ~bucket_bytes each.

        fb = FlatBuckets(bucket_order(model), bucket_bytes=25 * 2**20, world_size=4)
        fb.bind_params(); fb.bind_grads()     # parameters and gradients become views
        fb.buckets[0].grad                    # one flat buffer to all-reduce / reduce-scatter
        fb.where[p]                           # (bucket index, position in bucket)

    A parameter larger than bucket_bytes gets a bucket of its own. The split depends only
    on the parameters' sizes and dtype, so every rank builds the same buckets. `order`, if
    given, reorders the parameters inside each bucket (the engines put each optimizer
    parameter group in one contiguous range: zerolab.optim.param_groups). `quantum`, if given,
    pads each bucket to a multiple of it instead of N (the bitwise mode: N * its norm block).
    """

    def __init__(self, params, bucket_bytes: float, world_size: int, order=None, quantum: int | None = None):
        params = list(params)
        if not params:
            raise ValueError("FlatBuckets: no parameters to put in buckets")
        if not bucket_bytes > 0:
            raise ValueError(f"FlatBuckets: bucket_bytes must be > 0, got {bucket_bytes!r}")
        groups, current, current_bytes = [], [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if current and current_bytes + nbytes > bucket_bytes:
                groups.append(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += nbytes
        groups.append(current)
        if order is not None:
            groups = [list(order(g)) for g in groups]
        self.world_size = world_size
        self.buckets = [Bucket(i, g, world_size, quantum) for i, g in enumerate(groups)]
        self.where = {p: (b.index, i) for b in self.buckets for i, p in enumerate(b.params)}

    @property
    def params(self) -> list:
        return [p for b in self.buckets for p in b.params]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)

    def bind_params(self) -> None:
        for b in self.buckets:
            b.bind_params()

    def bind_grads(self, dtype=None) -> None:
        for b in self.buckets:
            b.bind_grads(dtype)

    def attach_grads(self) -> None:
        for b in self.buckets:
            b.attach_grads()

    def release_grads(self) -> None:
        for b in self.buckets:
            b.release_grads()

    def zero_grads(self) -> None:
        for b in self.buckets:
            b.grad.zero_()

    def __len__(self):
        return len(self.buckets)

    def __repr__(self):
        return f"FlatBuckets({len(self.buckets)} buckets, numel={self.numel}, padded={self.padded_numel})"
