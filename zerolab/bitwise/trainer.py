"""A small data-parallel trainer whose weights are the same bits on 1, 2, 4 or 8 ranks.

    plan = ChunkPlan(num_chunks=16, world_size=zl.world_size())
    trainer = BitwiseDataParallel(model, partial(torch.optim.AdamW, lr=1e-3), loss_fn, plan,
                                  precision="bf16", max_grad_norm=1.0, shard_optimizer=True)
    for step in range(steps):
        trainer.train_step(data.global_batch(step, 64), micro_batches=2)

One step, and what fixes its order:
  1. each of this rank's chunks: its own forward and backward (zerolab.bitwise.chunks); the
     chunk gradients, fed a micro-batch at a time, are added in this rank's subtree of the
     fixed tree (TreeAccumulator): accumulation is just more leaves of the same tree;
  2. across ranks: recursive halving along the tree (a reduce-scatter), then, for a whole
     vector, an all-gather (zerolab.bitwise.tree); then divide by C, a power of two: exact.
     With ChunkPlan(interleaved=True) the order of 1 and 2 turns round: each chunk is
     reduce-scattered as soon as it is computed (its round's lower levels cross ranks) and
     the rounds are added on the shard, so no full-size partial sum outlives a chunk;
  3. clip: the squared norm, computed exactly (zerolab.bitwise.norm), so no order matters;
  4. the optimizer steps the fp32 master vector, whole or this rank's shard.

Why the update is layout-independent: SGD and AdamW with foreach=False update each element
from that element's own gradient, weight and moments, with per-step scalars (lr, bias
corrections) that are the same on every rank. A whole vector, a shard of it, or one tensor per
parameter gives every element the same arithmetic. (Element-wise CPU kernels run full vector
lanes and a scalar tail; tests/test_bitwise_units.py checks that a slice at any offset gets the
same bits as the whole, which is what makes the lane boundaries irrelevant. Shards also start
at multiples of NORM_BLOCK elements, so lanes line up anyway.) Optimizers outside that family, or
these with foreach or fused kernels, are refused by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.comm import Ledger
from ..precision import policy
from .chunks import ChunkPlan, chunk_gradient, split_rows
from .flat import FlatLayout, trainable_parameters
from .norm import clip_coefficient, exact_sum_of_squares
from .tree import TreeAccumulator, tree_all_reduce, tree_reduce_scatter

NORM_BLOCK = 256        # shards start at multiples of this many elements (a power of two)

# Optimizers whose update is elementwise, so the layout cannot change a bit (with foreach=False).
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def check_elementwise_optimizer(optimizer) -> None:
    """Refuse an optimizer whose update could depend on how the vector is cut."""
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        raise ValueError(f"bitwise mode: {type(optimizer).__name__} is not one of "
                         f"{', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}, whose updates are "
                         f"elementwise; an update that reads whole matrices or rows depends on the layout")
    for group in optimizer.param_groups:
        for key in ("foreach", "fused"):
            if group.get(key):
                raise ValueError(f"bitwise mode: build the optimizer with {key}=False (or leave it unset): "
                                 f"the mode steps with the single-tensor kernels on every engine")
        group["foreach"] = False        # torch's default picks per device: say it once, here


class BitwiseDataParallel:
    """Data parallelism with every order of addition fixed (see the module's docstring).

    model: every rank starts from rank 0's parameters (frozen ones too) and buffers, broadcast.
    optimizer: a factory params -> SGD | Adam | AdamW (foreach and fused unset or False).
    loss_fn(model, chunk) -> loss or (output, loss): the chunk's MEAN loss.
    precision: "fp32", or "bf16" (bf16 model and gradients, fp32 master weights and sums).
    shard_optimizer: False keeps the whole fp32 vector and optimizer state on every rank (DDP);
    True keeps only this rank's shard of them (ZeRO-1/2 style), and gathers the weights after
    the step. Either way the weights are the same bits.
    params: the trainable parameters in the flat vector's order (default: the model's order).
    No bit depends on it: the sums are elementwise and the clip's norm is exact.
    """

    def __init__(self, model: torch.nn.Module, optimizer, loss_fn, plan: ChunkPlan, *, precision: str = "fp32",
                 max_grad_norm: float | None = None, shard_optimizer: bool = False, block: int = NORM_BLOCK,
                 ledger: Ledger | None = None, params=None):
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if plan.world_size != self.world_size:
            raise ValueError(f"bitwise mode: the chunk plan is for {plan.world_size} ranks, this world has "
                             f"{self.world_size}")
        self.policy = policy(precision)
        if self.policy.loss_scaling:
            raise ValueError("bitwise mode: fp16 is not supported (its loss scale skips steps by overflow); "
                             "use 'fp32' or 'bf16'")
        self.model, self.loss_fn, self.plan = model, loss_fn, plan
        self.max_grad_norm, self.shard_optimizer = max_grad_norm, shard_optimizer
        self.comm = ledger if ledger is not None else Ledger()
        self._check_same_threads()
        with torch.no_grad():       # every rank starts from rank 0's model: frozen weights and buffers too
            for t in [*model.parameters(), *model.buffers()]:
                self.comm.broadcast(t.data, src=0, tag="bitwise:setup")     # a copy: no arithmetic
        params = trainable_parameters(model) if params is None else list(params)
        self.layout = FlatLayout(params, self.world_size, block)
        master = self.layout.flatten([p.detach() for p in self.layout.params])
        model.to(self.policy.compute_dtype)
        self.layout.write_into_params(master)
        self.master = self.layout.shard(master, self.rank).clone() if shard_optimizer else master
        self.optimizer = optimizer([self.master])
        check_elementwise_optimizer(self.optimizer)
        self._tree = TreeAccumulator(plan.chunks_per_rank)
        self._chunk_rows = None
        self.last_clip_coefficient = None     # the last step's clip coefficient (a 0-d tensor), if clipping

    # ------------------------------------------------------------------ the step in pieces
    def backward(self, micro_batch, chunk_rows: int) -> None:
        """This rank's next chunks (a micro-batch of whole `chunk_rows`-row chunks, in order):
        each chunk's forward and backward on its own, added into this rank's subtree."""
        if self._chunk_rows not in (None, chunk_rows):
            raise ValueError(f"bitwise mode: chunks of {chunk_rows} rows after chunks of {self._chunk_rows} "
                             f"in the same step: every chunk of a step has the same size")
        self._chunk_rows = chunk_rows
        for chunk in split_rows(micro_batch, chunk_rows):
            if self._tree.added == self._tree.count:
                raise RuntimeError(f"bitwise mode: this rank owns {self._tree.count} chunks per step and "
                                   f"was given more before step()")
            grad = chunk_gradient(self.model, self.loss_fn, chunk, self.layout, self.policy.compute_dtype)
            if self.plan.interleaved:       # this chunk is this rank's leaf of a round: add across ranks now
                grad = tree_reduce_scatter(grad, self.comm)
            self._tree.add(grad)

    def step(self) -> None:
        """Add the chunks across ranks in the fixed tree, clip, update, refresh the model's weights."""
        local = self._tree.result()
        self._tree, self._chunk_rows = TreeAccumulator(self.plan.chunks_per_rank), None
        if self.plan.interleaved:           # the rounds' sums, on this rank's shard
            grad = local if self.shard_optimizer else self._gather(local)
        else:                               # this rank's subtree, whole: the top levels cross ranks
            grad = (tree_reduce_scatter if self.shard_optimizer else tree_all_reduce)(local, self.comm)
        grad.mul_(1.0 / self.plan.num_chunks)   # the mean over chunks; C is a power of two: exact
        if self.max_grad_norm is not None:
            sumsq = exact_sum_of_squares(grad, self.comm, sharded=self.shard_optimizer)
            self.last_clip_coefficient = clip_coefficient(sumsq, self.max_grad_norm)
            grad.mul_(self.last_clip_coefficient)
        self.master.grad = grad
        self.optimizer.step()
        self.master.grad = None
        self.layout.write_into_params(self.full_master())

    def train_step(self, global_batch, micro_batches: int = 1) -> None:
        """One step on the global batch (every rank passes the whole of it; each takes its chunks),
        fed in `micro_batches` micro-batches of whole chunks (gradient accumulation)."""
        tensors = global_batch if isinstance(global_batch, (tuple, list)) else (global_batch,)
        rows = tensors[0].shape[0]
        chunk_rows = self.plan.chunk_rows(rows)
        if micro_batches < 1 or self.plan.chunks_per_rank % micro_batches:
            raise ValueError(f"bitwise mode: {micro_batches} micro-batches cannot share this rank's "
                             f"{self.plan.chunks_per_rank} chunks equally")
        mine = self.plan.rank_rows(rows, self.rank)          # this rank's chunks' rows, chunk by chunk
        local = tuple(t[mine] for t in tensors)
        for micro in split_rows(local, chunk_rows * self.plan.chunks_per_rank // micro_batches):
            self.backward(micro, chunk_rows)
        self.step()

    def _check_same_threads(self) -> None:
        """Refuse ranks that compute with different numbers of intra-op threads: a CPU matmul
        splits its work by thread, so a chunk's gradient would depend on which rank computes it."""
        threads = torch.tensor([torch.get_num_threads(), -torch.get_num_threads()])
        self.comm.all_reduce(threads, op="max", tag="bitwise:setup")
        if threads[0] != -threads[1]:
            raise ValueError(f"bitwise mode: the ranks compute with between {-int(threads[1])} and "
                             f"{int(threads[0])} threads; give every rank the same torch.set_num_threads")

    def conditions(self) -> dict:
        """What else must match for two runs to end with the same bits (compare these between a
        run on 1 rank and one on N): the same torch, the same CPU kernel set, the same threads per
        rank, and the same chunks. The world size, and sharding or not, are free."""
        return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "threads_per_rank": torch.get_num_threads(), "num_chunks": self.plan.num_chunks,
                "norm_block": self.layout.block, "precision": self.policy.name}

    # ------------------------------------------------------------------ reading the state
    def _gather(self, shard: torch.Tensor, tag: str = "bitwise:gather") -> torch.Tensor:
        """The whole flat vector from every rank's shard (a concatenation: nothing is added)."""
        if self.world_size == 1:
            return shard
        full = torch.empty(self.layout.padded, dtype=shard.dtype)
        self.comm.all_gather(full, shard.contiguous(), tag=tag)
        return full

    def full_master(self) -> torch.Tensor:
        """The whole fp32 master vector (gathered from the shards when they are sharded)."""
        return self._gather(self.master, "bitwise:weights") if self.shard_optimizer else self.master

    def master_state(self) -> dict:
        """{name: fp32 master weight} in the model's names (every rank calls it when sharded)."""
        full = self.full_master()
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: full[off:off + n].view(p.shape).clone()
                for p, off, n in zip(self.layout.params, self.layout.offsets, self.layout.numels)}

    def optimizer_state(self) -> dict:
        """{state name: whole flat tensor without padding} (gathered when sharded; every rank calls it)."""
        state = self.optimizer.state[self.master]
        out = {}
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.shape == self.master.shape:
                if self.shard_optimizer:
                    value = self._gather(value, "bitwise:state")
                out[key] = value[:self.layout.numel].clone()
            else:
                out[key] = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
        return out
