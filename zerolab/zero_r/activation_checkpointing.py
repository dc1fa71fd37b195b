"""Activation checkpointing, and ZeRO-R's partitioned (P_a) and offloaded (P_a+cpu) checkpoints.

Without checkpointing, autograd keeps every intermediate result of every block until the
backward pass. With it, each block keeps only its input and runs its forward again during
backward (about one extra forward of compute).

Under tensor parallelism that kept input is the same on every model-parallel rank: mp
copies of one tensor. ZeRO-R removes the copies (paper, section 6.1):

* P_a: each mp rank keeps only its 1/mp slice of the block input; before the recompute,
  one all-gather over the mp group rebuilds the whole input.
* P_a+cpu: the slice goes to CPU memory (pinned, on a GPU machine) right after forward
  and comes back, asynchronously, one block ahead of the backward pass.

    ckpt = zl.activation_checkpointing.enable(model)                                   # plain
    ckpt = zl.activation_checkpointing.enable(model, mesh, partition_activations=True)  # P_a
    ckpt = zl.activation_checkpointing.enable(model, mesh, partition_activations=True,
                                   offload_activations=True)                # P_a+cpu

Plain checkpointing uses PyTorch's non-reentrant torch.utils.checkpoint. P_a needs to
decide what is kept, so it is a small autograd Function that recomputes inside its
backward; both restore the RNG state so dropout masks are the same when recomputed.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ..memory import live_bytes
from .mesh import Mesh


class ActivationCheckpointing:
    """How a model's blocks keep their inputs; installed with `enable`."""

    def __init__(self, mesh: Mesh | None = None, *, partition_activations: bool = False,
                 offload_activations: bool = False):
        if offload_activations and not partition_activations:
            raise ValueError("offload_activations=True offloads the partitioned checkpoints (P_a+cpu): "
                             "it needs partition_activations=True as well")
        if partition_activations and (mesh is None or mesh.mp < 2):
            raise ValueError("partition_activations=True splits checkpoints over a model-parallel "
                             "group, so it needs a Mesh with mp >= 2 (got "
                             f"{'no mesh' if mesh is None else f'mp={mesh.mp}'}); without model "
                             "parallelism there is nothing replicated to partition")
        self.mesh = mesh
        self.partition = partition_activations
        self.offload = offload_activations
        self.kept: list = []             # what each block keeps until its backward
        self.offloaded_bytes = 0         # bytes copied to the offload pool, since reset_counters()
        self.gathered_bytes = 0          # bytes re-gathered before recomputes, since reset_counters()

    def __call__(self, block, x):
        if not torch.is_grad_enabled():
            return block(x)              # eval / no_grad: nothing to keep
        if not self.partition:
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return _PartitionedCheckpoint.apply(block, self, x)

    def reset_counters(self) -> None:
        self.offloaded_bytes = self.gathered_bytes = 0

    def kept_bytes(self) -> int:
        """Measured bytes of the slices kept for backward right now (device and pool)."""
        return live_bytes([k for k in self.kept if k is not None])

    # -------------------------------------------------------------- P_a pieces
    def keep(self, x: torch.Tensor) -> tuple:
        """This rank's slice of x: a fresh copy (so the whole x can be freed), maybe offloaded."""
        flat = x.detach().reshape(-1)
        n = self.mesh.mp
        size = -(-flat.numel() // n)
        start = min(self.mesh.mp_rank * size, flat.numel())
        piece = torch.zeros(size, dtype=x.dtype, device=x.device)
        mine = flat[start:start + size]
        piece[:mine.numel()].copy_(mine)
        if self.kept and all(k is None for k in self.kept):
            self.kept.clear()            # the previous backward restored every slice
        if self.offload:
            pinned = piece.device.type == "cuda"
            pool = torch.empty(size, dtype=x.dtype, device="cpu", pin_memory=pinned)
            pool.copy_(piece, non_blocking=pinned)
            self.offloaded_bytes += pool.numel() * pool.element_size()
            piece = pool
        index = len(self.kept)
        self.kept.append(piece)
        return index, piece

    def restore(self, index: int, piece: torch.Tensor, shape, device) -> torch.Tensor:
        """All-gather the slices over the mp group and rebuild the whole input."""
        piece = piece.to(device, non_blocking=True)
        full = torch.empty(piece.numel() * self.mesh.mp, dtype=piece.dtype, device=device)
        self.mesh.ledger.all_gather(full, piece, group=self.mesh.mp_group, tag="pa_gather")
        self.gathered_bytes += full.numel() * full.element_size()
        self.kept[index] = None
        numel = 1
        for d in shape:
            numel *= d
        return full[:numel].view(shape)


class _PartitionedCheckpoint(torch.autograd.Function):
    """Run a block without keeping its internals; keep a 1/mp slice of its input."""

    @staticmethod
    def forward(ctx, block, policy, x):
        ctx.block, ctx.policy = block, policy
        ctx.shape, ctx.device = x.shape, x.device
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
        with torch.no_grad():
            y = block(x)
        ctx.index, piece = policy.keep(x)
        ctx.save_for_backward(piece)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (piece,) = ctx.saved_tensors
        x = ctx.policy.restore(ctx.index, piece, ctx.shape, ctx.device).detach().requires_grad_(True)
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)  # the same dropout masks as in forward
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            with torch.enable_grad():
                y = ctx.block(x)
        torch.autograd.backward(y, grad_y)
        return None, None, x.grad


def enable(model, mesh: Mesh | None = None, *, partition_activations: bool = False,
           offload_activations: bool = False) -> ActivationCheckpointing:
    """Checkpoint every block of a zerolab GPT (anything with `blocks` and `run_block`)."""
    if not hasattr(model, "run_block") or not hasattr(model, "blocks"):
        raise TypeError(f"activation checkpointing needs a model with `blocks` and `run_block` "
                        f"(zerolab.models.GPT); got {type(model).__name__}")
    if model.run_block is not None:
        raise ValueError("activation checkpointing is already enabled on this model; enable it once, "
                         "with all the options you want (partition_activations, offload_activations)")
    policy = ActivationCheckpointing(mesh, partition_activations=partition_activations,
                                     offload_activations=offload_activations)
    model.run_block = policy
    return policy


def disable(model) -> None:
    model.run_block = None
