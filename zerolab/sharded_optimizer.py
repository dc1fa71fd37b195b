"""ZeRO-1's optimizer half, for a script that keeps its own data parallelism: zl.ShardedOptimizer.

    model = DistributedDataParallel(model)        # the script's DDP averages the gradients
    opt = zl.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)
    loss.backward(); opt.step(); opt.zero_grad()  # as with any torch optimizer

This is the contract of PyTorch's ZeroRedundancyOptimizer: the gradients arrive averaged (every
rank holds the same p.grad); each rank keeps, and steps, the optimizer state of its own share of
the parameters only; after the step the updated parameters travel, so that every rank holds the
whole model again. The optimizer state, the biggest term of the model states (K Psi bytes,
K = 8 for Adam's two fp32 moments), is divided by N: the paper's P_os, with the gradients
reduced by someone else. zl.ZeRO(stage=1) is the same idea with the reduction built in (a
reduce-scatter where DDP all-reduces).

The shares are zerolab's layout (zerolab.buckets): the parameters of each parameter group
become views into ONE flat buffer, padded to a multiple of N, and rank r owns the contiguous
slice `bucket.shard(r)`. Its fp32 master (that slice itself when the parameters are fp32) and
its optimizer state exist for the slice only; one all-gather per group moves the slices after
the step, (N-1)/N of the group's bytes per rank, counted by the ledger `opt.comm`.

How it differs from torch's ZeroRedundancyOptimizer, which gives each rank WHOLE parameters
(greedily, by size): that works with any optimizer, but the shares are uneven (one large
embedding can outweigh a rank's whole share); cutting flat buffers gives every rank exactly
1/N, but the optimizer must update each element from its own state only (SGD, Adam, AdamW...;
Adafactor and Muon, which look at whole matrices, are refused).

state_dict() speaks the plain optimizer's format (one entry per parameter, in the order of
param_groups), so a checkpoint from here loads into torch.optim.AdamW(model.parameters()) and
back. As with ZeroRedundancyOptimizer, it needs consolidate_state_dict(to=rank) on every rank
first, and only rank `to` then holds it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .buckets import Bucket, held_still
from .comm import Ledger
from .engines.setup import WHOLE_TENSOR_OPTIMIZERS


class ShardedOptimizer(torch.optim.Optimizer):
    """optimizer_class on this rank's 1/N of every parameter group (see the module docstring).

    params, **defaults: as torch.optim's (parameter groups included); optimizer_class: an
    elementwise torch optimizer class; process_group: the ranks that share the state (default:
    the world). Outside torch.distributed it is the plain optimizer with one rank."""

    def __init__(self, params, optimizer_class, *, process_group=None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class such as "
                            f"torch.optim.AdamW, got {optimizer_class!r}")
        if issubclass(optimizer_class, WHOLE_TENSOR_OPTIMIZERS + (torch.optim.LBFGS,)):
            raise TypeError(f"{optimizer_class.__name__} does not update each element from its own "
                            "state (or needs a closure), so it cannot run on a slice of a flat buffer. "
                            "Use an elementwise optimizer (SGD, Adam, AdamW, ...).")
        self.optimizer_class = optimizer_class
        self.comm = Ledger(group=process_group)
        self.group = process_group
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.buckets, self.masters = [], []
        self.optim = None               # the torch optimizer on the owned slices (built below)
        self._consolidated = None       # consolidate_state_dict's result, on rank `to`
        super().__init__(params, defaults)   # (calls add_param_group for each group)
        self.optim = optimizer_class([self._inner_group(i) for i in range(len(self.param_groups))])

    # -------------------------------------------------------------- the layout
    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group; the group's parameters move into a flat buffer of their own,
        and this rank takes its slice of it."""
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        if len({(p.dtype, p.device) for p in params}) != 1:
            raise TypeError("ShardedOptimizer: the parameters of one group must share a dtype and a "
                            "device (they become views into one flat buffer); put others in a group of "
                            "their own")
        bucket = Bucket(len(self.buckets), params, self.world_size)
        with torch.no_grad():
            bucket.bind_params()        # every p.data is now a view into bucket.data
        mine = bucket.data[bucket.shard(self.rank)]
        master = mine if mine.dtype == torch.float32 else mine.float()   # fp32: the slice itself
        self.buckets.append(bucket)
        self.masters.append(master)
        if self.optim is not None:
            self.optim.add_param_group(self._inner_group(len(self.buckets) - 1))

    def _inner_group(self, i: int) -> dict:
        return {**self._hyper(i), "params": [self.masters[i]]}

    def _hyper(self, i: int) -> dict:
        return {k: v for k, v in self.param_groups[i].items() if k != "params"}

    # -------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None):
        """The owned slices step, then every group's slices are all-gathered."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        held = []
        for i, (bucket, master) in enumerate(zip(self.buckets, self.masters)):
            self.optim.param_groups[i].update(self._hyper(i))   # a scheduler's lr, this step
            master.grad, still = self._owned_grad(bucket)
            held += [(master, lo, hi) for lo, hi in still]
        with held_still(self.optim, held):     # a parameter with no gradient does not move
            self.optim.step()
        for bucket, master in zip(self.buckets, self.masters):
            master.grad = None
            mine = bucket.data[bucket.shard(self.rank)]
            if master is not mine:
                mine.copy_(master)              # the fp32 master, cast to the parameters' dtype
            if self.world_size > 1:
                self.comm.all_gather(bucket.data, mine.clone(), tag=f"param{bucket.index}")
        return loss

    def _owned_grad(self, bucket):
        """(fp32 gradient of this rank's slice, [(lo, hi)] ranges of it whose parameter has no
        gradient: held still, as a plain optimizer skips a parameter whose grad is None)."""
        s = bucket.shard(self.rank)
        grad = torch.zeros(s.stop - s.start, dtype=torch.float32, device=bucket.data.device)
        still = []
        for p, o, n in zip(bucket.params, bucket.offsets, bucket.sizes):
            lo, hi = max(o, s.start), min(o + n, s.stop)
            if lo >= hi:
                continue
            if p.grad is None:
                still.append((lo - s.start, hi - s.start))
            else:
                grad[lo - s.start:hi - s.start] = p.grad.reshape(-1)[lo - o:hi - o]
        return grad, still

    # -------------------------------------------------------------- state, in the plain format
    @torch.no_grad()
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's slice of the optimizer state; rank `to` (a rank of the group) keeps
        it in the plain optimizer's format for state_dict(). Every rank must call it."""
        state, index = {}, 0
        for i, (bucket, master) in enumerate(zip(self.buckets, self.masters)):
            mine = self.optim.state.get(master, {})
            full = {}
            for key in sorted(mine):
                value = mine[key]
                if torch.is_tensor(value) and value.shape == master.shape:
                    whole = torch.empty(bucket.padded_numel, dtype=value.dtype, device=value.device)
                    if self.world_size > 1:
                        self.comm.all_gather(whole, value.contiguous(), tag="state")
                    else:
                        whole.copy_(value)
                    full[key] = bucket.views(whole)
                else:               # a step count: the same on every rank
                    full[key] = [value] * len(bucket.params)
            for k in range(len(bucket.params)):
                if full:
                    state[index + k] = {key: (v[k].clone() if torch.is_tensor(v[k]) else v[k])
                                        for key, v in full.items()}
            index += len(bucket.params)
        groups, index = [], 0
        for i, group in enumerate(self.param_groups):
            groups.append({**self._hyper(i), "params": list(range(index, index + len(group["params"])))})
            index += len(group["params"])
        self._consolidated = {"state": state, "param_groups": groups} if self.rank == to else None

    def state_dict(self) -> dict:
        """The consolidated state (consolidate_state_dict(to=this rank) first, on every rank)."""
        if self._consolidated is None:
            raise RuntimeError("ShardedOptimizer: the state is sharded over the ranks. Call "
                               "consolidate_state_dict(to=rank) on every rank first; then rank `to` "
                               "has the whole state_dict(), in torch's format for a plain optimizer.")
        return self._consolidated

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """A plain optimizer's state dict over the same parameters (or one from state_dict()):
        each rank keeps its slice. Every rank calls it with the same dict."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("load_state_dict: the state dict's parameter groups do not match this "
                             "optimizer's (the number of groups, or of parameters in each)")
        for i, saved in enumerate(groups):
            self.param_groups[i].update({k: v for k, v in saved.items() if k != "params"})
            self.optim.param_groups[i].update(self._hyper(i))
            bucket, master = self.buckets[i], self.masters[i]
            s = bucket.shard(self.rank)
            per_param = [state_dict["state"].get(j) for j in saved["params"]]
            if all(st is None for st in per_param):
                continue
            slot = {}
            for p, o, n, st in zip(bucket.params, bucket.offsets, bucket.sizes, per_param):
                for key, value in (st or {}).items():
                    if torch.is_tensor(value) and value.numel() == n and value.dim() > 0:
                        flat = slot.setdefault(key, torch.zeros(bucket.padded_numel, dtype=value.dtype))
                        flat[o:o + n] = value.reshape(-1)
                    else:
                        slot.setdefault(key, value)
            self.optim.state[master] = {k: _mine(v, s, bucket.padded_numel, master.device)
                                        for k, v in slot.items()}
        self._consolidated = None


def _mine(value, shard: slice, padded: int, device):
    """This rank's copy of one loaded state entry: its slice of a flat one, or the scalar (a step
    count: a copy, so stepping this optimizer never changes the dict it was loaded from)."""
    if not torch.is_tensor(value):
        return value
    if value.dim() > 0 and value.numel() == padded:
        return value[shard].clone().to(device)
    return value.clone()
