"""Fixed chunks of the global batch, and one chunk's gradient computed on its own.

Why chunks: a rank's gradient in plain data parallelism is a sum over its share of the batch,
formed inside the backward's matmuls (a weight's gradient sums over rows, a bias's over the
batch dimension). How a kernel splits that sum depends on how many rows it sees, so 2 ranks
and 4 ranks add the same per-example terms in different orders. Here the global batch is cut
into `num_chunks` chunks whose number never depends on the world size; each chunk gets its own
forward and backward, so every chunk's gradient is the same bits whichever rank computes it.
The chunks' gradients are then added in one fixed tree (zerolab.bitwise.tree).

Why powers of two: the tree is a perfect binary tree over chunk indices, and rank r owns the
contiguous chunks [r*C/N, (r+1)*C/N). That run is a subtree of the global tree only when C/N
is a power of two and the runs are aligned, which holds for every N dividing C when C and N
are powers of two. Dividing the summed gradient by C is then also exact (a power of two).

Two ways to share the chunks out, the same tree either way (a chunk's index, not its rank,
decides where it sits in the tree):
  contiguous   rank r owns chunks r*C/N .. (r+1)*C/N - 1: its chunks are one subtree (the
               tree's lower levels, added inside the rank), and the ranks' subtrees meet in the
               top levels (one reduce-scatter per step); the rank holds full-size partial sums.
  interleaved  rank r owns chunks r, r+N, r+2N, ...: each round of N consecutive chunks (one per
               rank) is a subtree whose lower levels cross ranks (a reduce-scatter per round),
               and the rounds meet in the top levels, on shards: the rank holds only shards of
               partial sums (what ZeRO-2 and 3 need), at one reduce-scatter per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def is_power_of_two(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class ChunkPlan:
    """C chunks of every global batch, shared out over N ranks: rank r owns a contiguous run."""

    num_chunks: int
    world_size: int
    interleaved: bool = False

    def __post_init__(self):
        if not is_power_of_two(self.num_chunks):
            raise ValueError(f"bitwise mode: num_chunks must be a power of two (1, 2, 4, ...), got "
                             f"{self.num_chunks!r}: the chunks are added in one perfect binary tree")
        if not is_power_of_two(self.world_size):
            raise ValueError(f"bitwise mode: the world size must be a power of two (1, 2, 4, 8, ...), got "
                             f"{self.world_size!r}: each rank's chunks must form one subtree of the fixed tree")
        if self.num_chunks % self.world_size:
            raise ValueError(f"bitwise mode: num_chunks ({self.num_chunks}) must be a multiple of the world "
                             f"size ({self.world_size}): every rank owns the same number of whole chunks")

    @property
    def chunks_per_rank(self) -> int:
        return self.num_chunks // self.world_size

    def chunks_of(self, rank: int) -> range:
        """The chunk indices rank `rank` owns, in the order it computes them: a contiguous,
        aligned run (one subtree), or every N-th chunk from r (one leaf of each round)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        if self.interleaved:
            return range(rank, self.num_chunks, self.world_size)
        return range(rank * self.chunks_per_rank, (rank + 1) * self.chunks_per_rank)

    def chunk_rows(self, global_rows: int) -> int:
        """Rows in one chunk of a global batch of `global_rows` rows (refused unless C divides it)."""
        if global_rows % self.num_chunks:
            raise ValueError(f"bitwise mode: a global batch of {global_rows} rows cannot be cut into "
                             f"{self.num_chunks} equal chunks; use a batch that num_chunks divides")
        return global_rows // self.num_chunks

    def rank_rows(self, global_rows: int, rank: int) -> torch.Tensor:
        """The indices of the global batch's rows that rank `rank`'s chunks cover, chunk by chunk."""
        per_chunk = self.chunk_rows(global_rows)
        return torch.cat([torch.arange(c * per_chunk, (c + 1) * per_chunk) for c in self.chunks_of(rank)])


def split_rows(batch, rows: int) -> list:
    """Cut a batch (a tensor, or a tuple/list of tensors sharing dim 0) into pieces of `rows` rows."""
    tensors = batch if isinstance(batch, (tuple, list)) else (batch,)
    total = tensors[0].shape[0]
    if any(t.shape[0] != total for t in tensors):
        raise ValueError("bitwise mode: the batch's tensors must have the same number of rows")
    if total % rows:
        raise ValueError(f"bitwise mode: {total} rows do not hold a whole number of {rows}-row chunks")
    pieces = []
    for start in range(0, total, rows):
        piece = tuple(t[start:start + rows] for t in tensors)
        pieces.append(piece if isinstance(batch, (tuple, list)) else piece[0])
    return pieces


class CastInputs:
    """Calls the model with its floating-point inputs cast to the compute dtype, as the engines'
    forward does (bf16 compute); the loss function sees the model through this."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.model, self.dtype = model, dtype

    def __call__(self, *args, **kwargs):
        def cast(a):
            return a.to(self.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        return self.model(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})


def chunk_gradient(model: torch.nn.Module, loss_fn, chunk, layout, compute_dtype=torch.float32) -> torch.Tensor:
    """One chunk's gradient as a flat fp32 vector in `layout`'s order (padding zeros).

    loss_fn(model, chunk) returns the chunk's mean loss (or (output, loss), as zl.models.gpt_loss).
    A forward and a backward of this chunk alone: no other chunk's terms enter any kernel.
    The gradients are read and cleared, so the next chunk starts from nothing.
    """
    for p in layout.params:
        p.grad = None
    out = loss_fn(CastInputs(model, compute_dtype), chunk)
    loss = out[1] if isinstance(out, (tuple, list)) else out
    loss.backward()
    flat = layout.flatten([p.grad for p in layout.params])
    for p in layout.params:
        p.grad = None
    return flat
