"""Lab 7: the optimizer handed per-parameter views (chapter 6, "What the optimizer is handed, and
what its state dict holds").

Write the six methods below. ParamViewsLab is the library's class (zerolab.engines.param_views.
ParamViews) with them left out; its docstring lists the state you can use
(zerolab.labs.views.ParamViewsLab). The engine is zl.ZeRO(stage=1): its buckets, reduce-scatter,
all-gather and step are the library's, and it hands the torch optimizer what your class cuts. The
grader trains a small model with nanoGPT's two parameter groups on 2 ranks for 4 steps, numbered
0 to 3 as its messages number them; its forward takes a side block on steps 1 and 3 only. It
compares with a plain AdamW in one process on the global batch, parameter by parameter. Stuck? The
lab's notebook has hints, folded: open one at a time.

    python -m zerolab.labs grade views labs/lab7_views.py
"""

import torch

from zerolab.labs.views import ParamViewsLab, pack, unpack


class MyViews(ParamViewsLab):
    def _cut(self, i, flat, bucket, s):
        """Called once for each master while the engine is built. `flat` is master i: this rank's
        slice s (a slice(start, stop) of the bucket's padded flat buffer) of `bucket`, so flat[0]
        is the bucket's element s.start. Cut the tensor the optimizer will step for each of the
        bucket's parameters.

        Must set, for every parameter p of the bucket, self.view_of[id(p)]: a tensor that shares
        flat's memory (what the optimizer writes into it must be the model's weights) and holds
        exactly the elements of p that lie in this rank's slice: in p's own shape when all of p
        lies there; flat when the slice's edge cuts p (each of two ranks then holds a piece); an
        empty tensor when none of p is here (the optimizer must never step it).

        You will need again, for each parameter, which elements of flat its view covers and which
        elements of the flattened parameter those are (in point_grads, and for the state dict):
        keep them (self.where and self.piece are two dicts for that).

        May use: bucket.params, bucket.offsets, bucket.sizes (parameter j lies at
        [offsets[j], offsets[j] + sizes[j]) of the bucket), s.start, s.stop, p.shape, slicing and
        .view()."""
        raise NotImplementedError("_cut")

    def place(self, optimizer):
        """Called once, after the cut. The optimizer's param_groups hold the script's parameters
        (the model's own, in the script's groups and order). Must put in their place the views
        the optimizer will step, each in its parameter's group and position, and change nothing
        else: each group's settings then apply to its own parameters, and the state dict numbers
        them as a plain optimizer over the same groups does (positions 0, 1, 2, ... through the
        groups, in order).

        pieces, assemble and shard need to know which parameter stands at each position: keep it
        (self.order is there for that).

        May use: optimizer.param_groups (a list of dicts, each with "params": a list of tensors),
        self.view_of."""
        raise NotImplementedError("place")

    def point_grads(self, skip):
        """Called once the step's gradient is ready: each master's .grad is the averaged gradient
        of this rank's slice (flat, as long as the master). Must give every view that holds part
        of its parameter a .grad: the same range of its master's .grad as the view is of the
        master, in the view's shape, sharing its memory (no copy). Leave .grad None for an empty
        view, and for a parameter whose id is in `skip` (no rank's backward reached it since the
        last zero_grad): the optimizer then skips it, as a plain optimizer skips a parameter whose
        gradient is None, step count included.

        May use: self.masters[i].grad, self.params, self.view_of, what _cut kept."""
        raise NotImplementedError("point_grads")

    def pieces(self, local):
        """The first half of optimizer.state_dict(), which every rank calls:
        assemble(local, gather_bytes(pieces(local))) is its whole state, gather_bytes giving
        every rank every rank's bytes, in rank order. `local` is this rank's own state, keyed by
        position: {position: {"step": tensor(4.), "exp_avg": tensor in the view's shape,
        "exp_avg_sq": ...}}, with an entry only for a view the optimizer has stepped.

        Must return bytes: what the other ranks need of this rank's state to put each parameter's
        state back together (which elements of the flattened parameter each view's state holds).

        May use: local, self.order, what _cut kept, pack(obj) -> bytes."""
        raise NotImplementedError("pieces")

    def assemble(self, local, blobs):
        """The second half. `blobs` holds every rank's bytes from pieces (unpack(blob) gives back
        what pieces packed). Must return the whole model's state as one process's plain optimizer
        over the same groups would hold it: {position: {name: value}}, each per-element tensor
        whole and in its parameter's shape, the scalars (the step count) as they are, an entry
        for every parameter some rank has stepped and none for the others, in increasing
        position. Every rank returns the same.

        May use: local, blobs, unpack, self.order, self.shape (id(parameter) -> its shape), what
        _cut kept, torch.zeros."""
        raise NotImplementedError("assemble")

    def shard(self, state, groups):
        """optimizer.load_state_dict(sd) calls it first, with sd["state"] and sd["param_groups"]:
        a whole model's state, from a plain PyTorch optimizer or from optimizer.state_dict().
        Each key of `state` stands for the parameter at its position: the position of that key in
        the groups' "params" lists, read in order. Must return this rank's part of it, in the
        same form, for torch to load: for each view that holds part of its parameter, each
        per-element tensor cut to the elements the view covers, in the view's shape; the scalars
        as they are; no entry for a parameter none of whose elements are on this rank.

        May use: state, groups, self.order, what _cut kept, reshape, slicing."""
        raise NotImplementedError("shard")
