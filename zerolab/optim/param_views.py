"""What the optimizer is handed: one tensor per parameter, the part of it this rank updates.

The flat engines keep every trainable parameter inside a flat, padded buffer (zerolab.buckets),
and each rank updates one slice of that buffer: all of it (DDP), its 1/N shard (ZeRO-1 and 2),
its shard of a unit (ZeRO-3). The torch optimizer does not see those flat slices. It sees, in
the script's own parameter groups and in their order, ONE TENSOR PER PARAMETER: a view of the
part of that parameter inside this rank's slice (its fp32 master, in bf16 and fp16).

    a bucket's master  [ w (6) | b (4) | v (2) | pad ]      rank 0 updates [0, 6), rank 1 [6, 12)
    rank 0's views      w: whole, in its own shape     b: empty          v: empty
    rank 1's views      w: empty                       b: whole          v: whole

A view shares the buffer's memory, so what the optimizer writes is what the collectives move.
A parameter cut by a shard boundary gives each of the two ranks a flattened piece; one that
lies whole in this rank's slice keeps its shape; one outside it is an empty tensor that never
gets a gradient. Everything PyTorch's optimizers do parameter by parameter therefore stays
theirs: a parameter whose gradient is None is skipped, step count included (so one a branch
skipped on some steps gets Adam's bias correction of its own steps); each group's
hyperparameters apply to its own parameters; optimizer.state holds one entry per parameter.

The optimizer's state dict is the whole model's, in PyTorch's layout (`ParamViews.consolidate`:
every rank sends the state of its pieces, and each parameter's state is put together whole);
loading one (from zerolab at any world size or stage, or from a plain PyTorch run) gives each
rank the slice of every per-element tensor that its views cover (`ParamViews.shard`). The
flat buffers stay: the collectives still move whole buckets.
"""

from __future__ import annotations

import contextlib
import io
import math

import torch
import torch.distributed as dist


class ParamViews:
    """The optimizer's tensors over flat masters.

    masters[i] holds elements `slices[i]` of the flat, padded bucket `buckets[i]` (a
    zerolab.buckets.Bucket). `names` maps id(parameter) -> its name (error messages).
    """

    whole = None                     # optim.whole_matrix.WholeMatrices: cut parameters stepped whole
    _plan = None                     # point_grads' per-parameter lookups (_point_plan)

    def __init__(self, masters, buckets, slices, names=None, resident=None):
        self.names = names or {}
        self.buckets, self.slices = list(buckets), list(slices)
        self.resident = resident     # resident(i): a context in which master i is in memory (disk)
        self.view_of: dict = {}      # id(parameter) -> the view the optimizer steps
        self.where: dict = {}        # id(parameter) -> (master index, lo, hi) in master coordinates
        self.piece: dict = {}        # id(parameter) -> (lo, hi) of the flattened parameter
        self.shape: dict = {}        # id(parameter) -> the parameter's full shape
        self.params: list = []       # every parameter of the buckets, in bucket order
        self.bind(masters)

    def bind(self, masters) -> None:
        """Cut the views from `masters`."""
        self.masters = list(masters)
        self.view_of.clear()
        self.params = []
        for i, (m, bucket, s) in enumerate(zip(self.masters, self.buckets, self.slices)):
            with self.resident(i) if self.resident is not None else contextlib.nullcontext():
                self._cut(i, m.detach(), bucket, s)
        self.replanned()

    def replanned(self) -> None:
        """The views changed (bind; optim.whole_matrix): point_grads looks them up again."""
        self._plan = None

    def _point_plan(self) -> list:
        """What point_grads reads at every step, looked up once: per parameter its id, its view
        with the view's shape and strides, and where it lies (master, lo, hi)."""
        if self._plan is None:
            self._plan = [(id(p), v, v.shape, v.stride(), *self.where[id(p)])
                          for p in self.params for v in (self.view_of[id(p)],)]
        return self._plan

    def _cut(self, i, flat, bucket, s) -> None:
        for pc in bucket.pieces(s):
            p = pc.param
            if pc.size:
                view = flat[slice(*pc.in_slice)]
                if pc.whole:
                    view = view.view(p.shape)    # whole here: the parameter's own shape
                self.where[id(p)] = (i, *pc.in_slice)
                self.piece[id(p)] = pc.in_param
            else:
                view = flat[:0].view((0,) + tuple(p.shape[1:]))   # none here: never stepped on this rank
                self.where[id(p)] = (i, 0, 0)
                self.piece[id(p)] = (0, 0)
            self.view_of[id(p)] = view
            self.shape[id(p)] = tuple(p.shape)
            self.params.append(p)

    # -------------------------------------------------------------- the optimizer's groups
    def place(self, optimizer, moved=None) -> None:
        """Each group's parameters -> their views, in the group's own order. A parameter the
        buckets do not hold (frozen) keeps its place, so the optimizer's state dict numbers
        every parameter as a plain optimizer over the same groups does. `moved`: {id(old
        view): parameter} when the views are cut again (offload). A whole-matrix optimizer's
        parameter cut by a shard's edge is handed whole to one rank (optim.whole_matrix)."""
        from .whole_matrix import attach, whole_ids
        self.whole = attach(self, whole_ids(optimizer, moved))
        if self.whole is not None:      # (a torch.amp.GradScaler then reaches step(), which refuses it)
            optimizer._step_supports_amp_scaling = True
        self.order = []               # the parameter behind each position of the state dict
        for group in optimizer.param_groups:
            out = []
            for t in group["params"]:
                p = moved.get(id(t), t) if moved else t
                self.order.append(p)
                out.append(self.view_of.get(id(p), p))
            group["params"] = out

    def move(self, masters, optimizer) -> None:
        """The masters moved (offload's host copies): cut the views again and put them in the
        optimizer's groups in place of the old ones."""
        if self.whole is not None:
            raise TypeError("offload='optimizer' steps the optimizer on host copies of the shards; a "
                            "whole-matrix optimizer (Muon, Adafactor) needs the matrices a shard's edge "
                            "cuts put together on the device. Use offload=None, or an elementwise optimizer.")
        behind = {id(self.view_of[id(p)]): p for p in self.params}
        self.bind(masters)
        self.place(optimizer, moved=behind)

    def of_master(self, i) -> list:
        """[(view, its offset in master i)] of master i's parameters, in bucket order."""
        return [(self.view_of[id(p)], self.where[id(p)][1]) for p in self.params
                if self.where[id(p)][0] == i]

    # -------------------------------------------------------------- gradients at a step
    def point_grads(self, skip=(), only=None) -> None:
        """Give each view the same range of its master's .grad (the step's fp32 gradient). A
        parameter in `skip` (ids: no rank's backward reached it) and an empty view keep None,
        so the optimizer skips them as it skips a parameter without a gradient. `only`: the
        master indices to point (offload="disk" steps one unit at a time)."""
        grads = [m.grad for m in self.masters]
        # (once per master, not per parameter: a CPU rank pays for every Python step here)
        contiguous = [g is not None and g.is_contiguous() for g in grads]
        offsets = [g.storage_offset() if c else 0 for g, c in zip(grads, contiguous)]
        for pid, view, shape, stride, i, lo, hi in self._point_plan():
            if only is not None and i not in only:
                continue
            grad = grads[i]
            if lo == hi or grad is None or pid in skip:
                view.grad = None
            elif contiguous[i]:             # one operation: the range, in the view's shape
                view.grad = grad.as_strided(shape, stride, offsets[i] + lo)
            else:
                view.grad = grad[lo:hi].view(shape)

    def drop_grads(self) -> None:
        for view in self.view_of.values():
            view.grad = None

    # -------------------------------------------------------------- checkpoints
    def segments(self, names) -> list:
        """Checkpoint segments (view, 0, name, lo, hi): each non-empty view is one piece of its
        parameter, with its optimizer state beside it."""
        out = self.whole.segments(names) if self.whole is not None else []
        for p in self.params:
            lo, hi = self.piece[id(p)]
            if self.whole is not None and id(p) in self.whole.values:
                continue            # (stepped whole by its owner: its values are in the masters)
            if lo < hi:
                out.append((self.view_of[id(p)], 0, names[id(p)], lo, hi))
        return out

    # -------------------------------------------------------------- the state dict, whole
    def _index(self):
        """[(position in the state dict, parameter)] of the parameters held in buckets."""
        return [(k, p) for k, p in enumerate(self.order) if id(p) in self.view_of]

    def consolidate(self, local: dict, gather_bytes) -> dict:
        """The whole model's optimizer state from this rank's `local` packed state
        (optimizer.state_dict()["state"], keyed by position): every rank sends the state of its
        pieces (gather_bytes(bytes) -> every rank's bytes: a collective) and each parameter's
        state is put together whole (assemble)."""
        return self.assemble(local, gather_bytes(self.pieces(local)))

    def pieces(self, local: dict) -> bytes:
        """What this rank sends: {position: (lo, hi, state)} of its non-empty views, serialized."""
        mine = {}
        for k, p in self._index():
            lo, hi = self.piece[id(p)]
            if lo < hi and k in local:
                mine[k] = (lo, hi, local[k])
        buf = io.BytesIO()
        torch.save(mine, buf)
        return buf.getvalue()

    def assemble(self, local: dict, blobs: list) -> dict:
        """Every rank's pieces -> each parameter's state whole: its per-element tensors in its
        shape, its other entries (a step count) from the rank that holds its first element.
        Positions of parameters outside the buckets (frozen) keep this rank's entry."""
        received: dict = {}
        for blob in blobs:
            for k, piece in torch.load(io.BytesIO(blob), weights_only=True).items():
                received.setdefault(k, []).append(piece)
        held = {k for k, _ in self._index()}
        out = {k: v for k, v in local.items() if k not in held}
        for k, p in self._index():
            if k not in received:
                continue            # never stepped anywhere: no state, as in a plain optimizer
            shape = self.shape[id(p)]
            state, whole = {}, {}
            for lo, hi, entries in sorted(received[k], key=lambda piece: piece[0]):
                for key, value in entries.items():
                    if _per_element(value, hi - lo):
                        if key not in whole:
                            whole[key] = torch.zeros(math.prod(shape), dtype=value.dtype)
                        whole[key][lo:hi] = value.reshape(-1).cpu()
                    elif lo == 0:
                        state[key] = value
            state.update({key: t.view(shape) for key, t in whole.items()})
            out[k] = state
        return dict(sorted(out.items()))

    def shard(self, state: dict, groups: list) -> dict:
        """A whole-model packed state (zerolab's or a plain PyTorch optimizer's) -> this rank's:
        each per-element tensor cut to the piece its view covers (in the view's shape); nothing
        for a parameter none of whose elements are here. `groups`: the state dict's
        param_groups, whose "params" say which position each key of `state` stands for."""
        position = {key: k for k, key in enumerate(key for g in groups for key in g["params"])}
        out = dict(state)
        for key, entries in state.items():
            k = position.get(key)
            p = self.order[k] if k is not None and k < len(self.order) else None
            if p is None or id(p) not in self.view_of:
                continue            # (a frozen parameter's entry, if any, stays as it is)
            shape, (lo, hi) = self.shape[id(p)], self.piece[id(p)]
            if lo == hi:
                del out[key]
                continue
            view = self.view_of[id(p)]
            mine = {}
            for name, value in entries.items():
                if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == shape:
                    mine[name] = value.reshape(-1)[lo:hi].reshape(view.shape).clone()
                elif torch.is_tensor(value) and value.numel() > 1 and hi - lo < math.prod(shape):
                    raise ValueError(
                        f"optimizer.load_state_dict: the state {name!r} of "
                        f"{self.names.get(id(p), f'parameter {k}')} (position {k}) has shape "
                        f"{tuple(value.shape)}, the parameter {shape}: this state dict belongs to "
                        "another model, or to parameter groups in another order")
                else:               # (a copy: stepping never changes the dict it came from)
                    mine[name] = value.clone() if torch.is_tensor(value) else value
            out[key] = mine
        return out


def use_foreach(optimizer) -> list:
    """Set foreach=True, for one step, in the groups where the script left it to torch (None):
    torch picks its foreach path by itself only for CUDA tensors, and one call per operation over
    every parameter costs a CPU rank far less than one per parameter and operation. The same
    arithmetic, element by element. Returns the groups changed, to set back to None after."""
    changed = [g for g in optimizer.param_groups if "foreach" in g and g["foreach"] is None
               and not g.get("fused") and not g.get("differentiable")]
    for g in changed:
        g["foreach"] = True
    return changed


def _per_element(value, n) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == n


def gather_bytes(ledger, group=None, device="cpu", tag="optimizer.state"):
    """gather_bytes(data) -> every rank's `data`, in rank order: two all-gathers through the
    ledger (the lengths, then the bytes padded to the longest), on `device` (NCCL: the GPU)."""
    group = ledger.group if group is None else group

    def gather(data: bytes) -> list:
        n = dist.get_world_size(group) if dist.is_initialized() else 1
        if n == 1:
            return [data]
        lengths = torch.empty(n, dtype=torch.int64, device=device)
        ledger.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device),
                          group=group, tag=tag)
        lengths = lengths.tolist()
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = torch.empty(n * max(lengths), dtype=torch.uint8, device=device)
        ledger.all_gather(every, mine.to(device), group=group, tag=tag)
        every = every.cpu()
        return [every[r * max(lengths):r * max(lengths) + size].numpy().tobytes()
                for r, size in enumerate(lengths)]
    return gather
