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

The shares are zerolab's layout (zerolab.buckets): every parameter of one dtype and device,
whatever its group, becomes a view into ONE flat buffer, padded to a multiple of N, and rank r
owns the contiguous slice `bucket.shard(r)` (so each rank holds 1/N of all the parameters, as
ZeroRedundancyOptimizer's partition aims to: a group added later joins its dtype's buffer, laid
out again). Its fp32 master (that slice itself when the parameters are fp32) and its optimizer
state exist for the slice only; one all-gather per buffer moves the slices after the step,
(N-1)/N of the buffer's bytes per rank, counted by the ledger `opt.comm`.

The inner torch optimizer (`opt.optim`) is ZeRO-1's optimizer half, the same as zl.ZeRO's
(zerolab.optim.param_views): one tensor per parameter, the part of it in this rank's slice,
in the script's groups and order. So step counts are per parameter and a parameter without a
gradient is skipped, as a plain optimizer does; the groups' settings travel both ways between
this optimizer and the inner one (a scheduler's lr in, a key the inner class adds out).

How it differs from torch's ZeroRedundancyOptimizer, which gives each rank WHOLE parameters
(greedily, by size): that works with any optimizer, but the shares are uneven (one large
embedding can outweigh a rank's whole share); cutting flat buffers gives every rank exactly
1/N, but a parameter cut at a slice's edge reaches the optimizer in two flattened pieces. An
elementwise optimizer (SGD, Adam, AdamW...) steps the pieces as they are; a whole-matrix one
(Muon, Adafactor) gets each cut parameter whole on one rank, its owner, which gathers the pieces
before the step and sends them back after it (zerolab.optim.whole_matrix). Muon beside AdamW
is two ShardedOptimizers, one on the matrices and one on the rest, as in a plain script.

The inner optimizer's state answers to the script's parameters, as ZeroRedundancyOptimizer's
does: opt.optim.state[p] is the state of p's view. For a parameter that lies whole in this rank's
slices that is p's own state (momentum_buffer in p's shape); for one a slice's edge cuts, the
state of this rank's flattened piece; for one wholly on other ranks, nothing (an empty dict).
The dict's keys stay the views (what the inner optimizer steps).

step(closure, **kwargs) passes both to the inner optimizer's step, as ZeroRedundancyOptimizer's
does: the inner optimizer calls the closure (or not: a subclass whose step takes no closure, or
a keyword of its own). The gradients are taken from p.grad before the inner step and again after
the closure has run, so the update sees what the closure's backward left there.

Uneven inputs: inside torch.distributed.algorithms.join.Join, a rank that ran out of batches
keeps stepping with the others (its join hook), as ZeroRedundancyOptimizer does; the Join's own
counting all-reduce is PyTorch's, made only when this optimizer is the first of its joinables.

state_dict() speaks the plain optimizer's format (one entry per parameter, in the order of
param_groups, with every hyperparameter of the inner class), so a checkpoint from here loads
into torch.optim.AdamW(model.parameters()) and back. As with ZeroRedundancyOptimizer, it needs
consolidate_state_dict(to=rank) on every rank first, and only rank `to` then holds it.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ..buckets import Bucket
from ..runtime.comm import Ledger
from ..bitwise.trainer import check_elementwise_optimizer
from . import whole_matrix
from .param_views import ParamViews, gather_bytes


class ShardedOptimizer(torch.optim.Optimizer, Joinable):
    """optimizer_class on this rank's 1/N of every parameter group (see the module docstring).

    params, **defaults: as torch.optim's (parameter groups included); optimizer_class: an
    torch optimizer class (Muon and Adafactor too); process_group: the ranks that share the state (default:
    the world). Outside torch.distributed it is the plain optimizer with one rank.
    bitwise=True: beside zl.DDP(model, bitwise=True), the same weights at any N (engines.options.
    BITWISE): SGD, Adam or AdamW only, stepped with single-tensor kernels (foreach, fused refused),
    so each rank's slice gets the bits the whole tensor would."""

    def __init__(self, params, optimizer_class, *, process_group=None, bitwise: bool = False, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class such as "
                            f"torch.optim.AdamW, got {optimizer_class!r}")
        if issubclass(optimizer_class, torch.optim.LBFGS):
            raise TypeError(f"{optimizer_class.__name__} needs a closure that re-evaluates the loss at "
                            "every step. Use a first-order optimizer (SGD, Adam, AdamW, Muon, ...).")
        # the inner class checks its own keywords (a misspelt one is a TypeError naming it), on a
        # stand-in, before any parameter moves into a flat buffer
        optimizer_class([torch.zeros(1, 1, requires_grad=True)], **defaults)   # (2-D: Muon takes matrices only)
        self.optimizer_class = optimizer_class
        self.bitwise = bitwise          # the same bits at any N: see _build_inner
        self.comm = Ledger(group=process_group)
        self.group = process_group
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.buckets, self.masters = [], []
        self.optim = None               # the torch optimizer on the owned slices (built below)
        self._consolidated = None       # consolidate_state_dict's result, on rank `to`
        super().__init__(params, defaults)   # (calls add_param_group for each group)
        Joinable.__init__(self)
        self._lay_out()
        self._build_inner()

    # -------------------------------------------------------------- the layout
    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group. Every parameter of one dtype and device, whatever its group,
        is a view into one flat buffer, of which this rank takes its slice; a group added after
        construction joins its dtype's buffer, laid out again (the values, the fp32 masters and
        the optimizer state carried over). Every rank must call it (as ZeroRedundancyOptimizer's)."""
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        if any(p.is_sparse for p in params):
            raise ValueError("ShardedOptimizer supports dense parameters only: a sparse one cannot "
                             "become a view into a flat buffer")
        if len({(p.dtype, p.device) for p in params}) != 1:
            raise ValueError("ShardedOptimizer: the parameters of one group must share a dtype and a "
                             "device (they become views into one flat buffer); put others in a group of "
                             "their own")
        if self.optim is not None:
            self._lay_out()
            self._build_inner()

    @torch.no_grad()
    def _lay_out(self) -> None:
        """One flat buffer per (dtype, device) over every group's parameters, in the groups' order;
        this rank's slice of each, and its fp32 master (the slice itself when fp32). Laid out
        again (a group was added): every rank's state and fp32 masters are first put together
        (collectives), then cut to the new slices."""
        self._carried = None
        if self.optim is not None:
            self._carried = self.views.consolidate(self.optim.state_dict()["state"],
                                                   gather_bytes(self.comm, self.group, self._device()))
        values = self._full_masters()
        everyone = [p for g in self.param_groups for p in g["params"]]
        kinds = list(dict.fromkeys((p.dtype, p.device) for p in everyone))
        self.buckets, self.masters = [], []
        for i, kind in enumerate(kinds):
            bucket = Bucket(i, [p for p in everyone if (p.dtype, p.device) == kind], self.world_size)
            bucket.bind_params()        # every p.data is now a view into bucket.data
            mine = bucket.data[bucket.shard(self.rank)]
            if mine.dtype == torch.float32:
                master = mine           # fp32: the slice itself
            else:                       # the fp32 values the masters held, where there were any
                flat = bucket.flat_copy(torch.float32)
                for view, p in zip(bucket.views(flat), bucket.params):
                    if id(p) in values:
                        view.copy_(values[id(p)])
                master = flat[bucket.shard(self.rank)].clone()
            self.buckets.append(bucket)
            self.masters.append(master)

    def _full_masters(self) -> dict:
        """{id(parameter): its whole fp32 master} of the buffers whose masters are copies (not
        fp32): all-gathered, so no precision is lost when they are laid out again."""
        out = {}
        for bucket, master in zip(self.buckets, self.masters):
            if master.dtype == bucket.data.dtype:
                continue
            full = torch.empty(bucket.padded_numel, dtype=torch.float32, device=master.device)
            if self.world_size > 1:
                self.comm.all_gather(full, master.clone(), tag="relayout")
            else:
                full.copy_(master)
            out.update({id(p): v for p, v in zip(bucket.params, bucket.views(full))})
        return out

    def _device(self):
        return self.masters[0].device if self.masters else torch.device("cpu")

    def _build_inner(self) -> None:
        """The inner optimizer over one view per parameter of the owned slices (the state carried
        over from before a new layout, cut to the new slices)."""
        self.views = ParamViews(self.masters, self.buckets, [b.shard(self.rank) for b in self.buckets])
        self.views.order = [p for g in self.param_groups for p in g["params"]]
        whole = whole_matrix.needs_whole(self.optimizer_class)
        self.views.whole = whole_matrix.attach(self.views, {id(p) for p in self.views.params} if whole else set())
        groups = [{**self._hyper(i), "params": [self.views.view_of[id(p)] for p in g["params"]]}
                  for i, g in enumerate(self.param_groups)]
        self.optim = self.optimizer_class(groups)
        if self.bitwise:    # an elementwise update with single-tensor kernels: a slice gets the whole's bits
            check_elementwise_optimizer(self.optim)
        if self._carried:
            fresh = self.optim.state_dict()
            self.optim.load_state_dict({"state": self.views.shard(self._carried, fresh["param_groups"]),
                                        "param_groups": fresh["param_groups"]})
        self._carried = None
        self._key_state_by_parameter()
        _sync_groups(self.optim.param_groups, self.param_groups)   # every key the inner class has

    def _key_state_by_parameter(self) -> None:
        """opt.optim.state[p] for the script's parameter p reads its view's state (module docstring);
        again after every load_state_dict of the inner optimizer, which makes a new dict."""
        self.optim.state = StateByParameter(self.optim.state, self.views.view_of)

    @property
    def _all_params(self) -> list:
        """Every parameter, in the groups' order (ZeroRedundancyOptimizer's name for them)."""
        return [p for g in self.param_groups for p in g["params"]]

    # -------------------------------------------------------------- uneven inputs: Join
    def join_hook(self, **kwargs) -> JoinHook:
        """Inside torch.distributed.algorithms.join.Join, a rank out of inputs keeps taking part in
        the others' steps (each all-gathers every rank's slices): it steps too."""
        return _StepWhenJoined(self)

    @property
    def join_device(self) -> torch.device:
        return self._device()

    @property
    def join_process_group(self):
        return self.group if self.group is not None else dist.group.WORLD

    def _hyper(self, i: int) -> dict:
        return {k: v for k, v in self.param_groups[i].items() if k != "params"}

    # -------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """The owned slices step, then every group's slices are all-gathered. closure and kwargs go
        to the inner optimizer's step (which calls the closure, if it takes one); its result is
        returned."""
        Join.notify_join_context(self)      # (inside Join, first of its joinables: uneven inputs)
        _sync_groups(self.param_groups, self.optim.param_groups)   # a scheduler's lr, this step
        self._take_grads()
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            def closure_then_grads():
                out = closure()
                self._take_grads()          # what the closure's backward left in p.grad
                return out
            loss = self.optim.step(closure_then_grads, **kwargs)
        if self.views.whole is not None:    # whole-matrix optimizers: new values back from owners
            self.views.whole.give_back(self.comm, self.group)
        self.views.drop_grads()
        for bucket, master in zip(self.buckets, self.masters):
            master.grad = None
            mine = bucket.data[bucket.shard(self.rank)]
            if master is not mine:
                mine.copy_(master)              # the fp32 master, cast to the parameters' dtype
            if self.world_size > 1:
                self.comm.all_gather(bucket.data, mine.clone(), tag=f"param{bucket.index}")
        _sync_groups(self.optim.param_groups, self.param_groups)   # what the inner step added
        return loss

    @torch.no_grad()
    def _take_grads(self) -> None:
        """The views' gradients from p.grad now (a parameter with none is skipped); a
        whole-matrix optimizer's cut parameters go to their owners."""
        without = set()
        for bucket, master in zip(self.buckets, self.masters):
            master.grad = self._owned_grad(bucket)
            without |= {id(p) for p in bucket.params if p.grad is None}
        self.views.point_grads(without)
        if self.views.whole is not None:
            self.views.whole.gather(self.comm, self.group, without)

    def _owned_grad(self, bucket):
        """The fp32 gradient of this rank's slice (zeros where a parameter has none)."""
        s = bucket.shard(self.rank)
        grad = torch.zeros(s.stop - s.start, dtype=torch.float32, device=bucket.data.device)
        for pc in bucket.pieces(s):
            if pc.size and pc.param.grad is not None:
                grad[slice(*pc.in_slice)] = pc.param.grad.reshape(-1)[slice(*pc.in_param)]
        return grad

    # -------------------------------------------------------------- state, in the plain format
    @torch.no_grad()
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Put every rank's pieces of the optimizer state together; rank `to` (a rank of the
        group) keeps the whole state in the plain optimizer's format for state_dict(). Every rank
        must call it."""
        local = self.optim.state_dict()
        device = self.masters[0].device if self.masters else "cpu"
        state = self.views.consolidate(local["state"], gather_bytes(self.comm, self.group, device))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(inner["params"])}
                  for g, inner in zip(self.param_groups, local["param_groups"])]
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
        each rank keeps the pieces its slices cover. Every rank calls it with the same dict."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("load_state_dict: the state dict's parameter groups do not match this "
                             "optimizer's (the number of groups, or of parameters in each)")
        mine = {"state": self.views.shard(state_dict["state"], groups),
                "param_groups": [dict(g) for g in groups]}
        self.optim.load_state_dict(mine)
        self._key_state_by_parameter()
        _sync_groups(self.optim.param_groups, self.param_groups)
        self._consolidated = None


def _sync_groups(src: list, dst: list) -> None:
    """Every setting but the parameters, from each group of `src` to the same group of `dst`."""
    for a, b in zip(src, dst):
        b.update({k: v for k, v in a.items() if k != "params"})


class StateByParameter(defaultdict):
    """The inner optimizer's state (keyed by the views it steps), also read by the script's
    parameters: state[p] is state[view of p]."""

    def __init__(self, state, view_of: dict):
        super().__init__(dict, state)
        self._view_of = view_of         # id(the script's parameter) -> its view

    def _key(self, k):
        view = self._view_of.get(id(k)) if isinstance(k, torch.Tensor) else None
        return k if view is None else view

    def __getitem__(self, k):
        return super().__getitem__(self._key(k))

    def __setitem__(self, k, v):
        super().__setitem__(self._key(k), v)

    def __delitem__(self, k):
        super().__delitem__(self._key(k))

    def __contains__(self, k):
        return super().__contains__(self._key(k))

    def get(self, k, default=None):
        return super().get(self._key(k), default)

    def __reduce__(self):               # (pickled and deep-copied as the plain dict it holds)
        return defaultdict, (dict, dict(self))


class _StepWhenJoined(JoinHook):
    """The step a rank that ran out of inputs takes while the others still train (Join)."""

    def __init__(self, optimizer: ShardedOptimizer):
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer.step()
