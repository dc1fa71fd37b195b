"""Lab 7: the optimizer handed per-parameter views (chapter 6, "What the optimizer is handed, and
what its state dict holds").

Every flat engine keeps its parameters in flat, padded buckets and updates one slice of each on
a rank, but hands the torch optimizer ONE TENSOR PER PARAMETER: a view of the part of it in this
rank's slice (zerolab.optim.param_views.ParamViews). The student writes the core of that class:

    _cut(i, flat, bucket, s)   the views of one master: whole and shaped, a flat piece, or empty
    place(optimizer)           the views into the script's own groups, in their order
    point_grads(skip)          each view's .grad: its range of the flat gradient; None if skipped
    pieces(local)              state_dict(), first half: what this rank sends of its state
    assemble(local, blobs)     state_dict(), second half: each parameter's state put back whole
    shard(state, groups)       load_state_dict(): a whole state dict cut to this rank's views

ParamViewsLab is the library's class with those left to write; ViewsEngine is zl.ZeRO(stage=1)
whose optimizer is handed the graded class's views. The grader trains LabNetWithBranch (a side
block the forward takes on steps 1 and 3 only) with nanoGPT's two parameter groups on 2 ranks and
compares, parameter by parameter, with a plain AdamW in one process on the global batch: the views
against the closed form of the layout the moment they are cut and placed, each view's gradient at
every step, the step counts, moments and weights after every step, optimizer.state_dict() after
steps 0 and 3, and a plain PyTorch checkpoint (after step 1) loaded into a new engine and continued.
The checks themselves are in zerolab.labs.views_checks (during the run, on every rank) and
zerolab.labs.views_parity (in the parent); the run's constants in zerolab.labs.views_spec.
"""

from __future__ import annotations

import copy
import io
import pickle

import torch
import torch.distributed as dist

from ..optim.param_views import ParamViews, gather_bytes
from ..engines.zero1 import ZeRO1
from . import views_parity
from .checks import Piece
from .engine_run import stub
from .lab import Check, Lab, Stop
from .model import LabNetWithBranch, global_micro_batch, loss_of, micro_batch
from .overlap import defined_at
from .views_checks import check_cut, check_grads, check_placed, loaded_problem
from .views_spec import (BRANCH, BUCKET_MB, CHECKPOINT_AFTER, DECAY, EPS, GRADS, LR, SEAMS, SECTION,
                         STATE_DICTS_AT, VIEWS)


def pack(obj) -> bytes:
    """Any picklable object (tensors included) -> bytes, for gather_bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes):
    """The object pack() turned into bytes."""
    return torch.load(io.BytesIO(data), weights_only=True)


class ParamViewsLab(ParamViews):
    """What the optimizer is handed, with its core left to write. What you can use:

    self.masters[i]       master i: this rank's slice of bucket i, a flat fp32 tensor that IS the
                          model's weights there (a view of the bucket's flat buffer); after
                          backward its .grad holds the slice's averaged gradient, flat, as long
    self.buckets[i]       bucket i (zerolab.buckets.Bucket): .params (its parameters, in the order
                          they lie in it), .offsets[j] and .sizes[j] (where parameter j starts in
                          the flat buffer, and its number of elements), .padded_numel
    self.slices[i]        the slice of bucket i this rank updates, slice(start, stop) in the
                          bucket's coordinates: element 0 of masters[i] is element `start`
    self.names            id(parameter) -> its name
    self.view_of          id(parameter) -> the tensor the optimizer steps for it (you fill it)
    self.where, self.piece   two empty dicts, yours: what you need to remember of each cut
    self.order            yours too (place): the parameter behind each position of the state dict
    self.params           after the cut: every parameter of the buckets, in bucket order
    self.shape            after the cut: id(parameter) -> its full shape

    and the helpers of zerolab.labs.views: pack(obj) -> bytes and unpack(bytes) -> obj.
    consolidate(local, gather_bytes), which optimizer.state_dict() calls, is the library's:
    assemble(local, gather_bytes(pieces(local))), gather_bytes(data) giving every rank's bytes.
    """

    def bind(self, masters) -> None:
        super().bind(masters)           # (calls _cut for each master)
        self.params = [p for b in self.buckets for p in b.params]
        self.shape = {id(p): tuple(p.shape) for p in self.params}


for _name in SEAMS:
    setattr(ParamViewsLab, _name, stub("lab 7", "ParamViewsLab", _name))

ReferenceViews = type("ReferenceViews", (ParamViewsLab,), {name: vars(ParamViews)[name] for name in SEAMS})


# ------------------------------------------------------------------ the closed form of the layout


def layout(buckets, rank: int, n: int, names: dict) -> dict:
    """name -> (bucket, [lo, hi) in the master, [plo, phi) of the flattened parameter, the view's
    shape): a parameter at [o, o + k) of a padded bucket P and rank r's slice [r P/N, (r+1) P/N)
    share [max, min); all of it -> its own shape, part -> a flat piece, none -> (0,)."""
    out = {}
    for b, bucket in enumerate(buckets):
        size = bucket.padded_numel // n
        start, stop = rank * size, (rank + 1) * size
        for p, o, k in zip(bucket.params, bucket.offsets, bucket.sizes):
            lo, hi = max(o, start), min(o + k, stop)
            if lo >= hi:
                out[names[id(p)]] = (b, 0, 0, 0, 0, (0,))
            else:
                shape = tuple(p.shape) if hi - lo == k else (hi - lo,)
                out[names[id(p)]] = (b, lo - start, hi - start, lo - o, hi - o, shape)
    return out


def groups_of(model) -> list:
    """nanoGPT's two groups: weight decay on matrices, none on biases."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": DECAY},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def optimizer_of(model):
    return torch.optim.AdamW(groups_of(model), lr=LR, eps=EPS)


def group_names(model) -> list:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in groups_of(model)]


def build_model() -> LabNetWithBranch:
    torch.manual_seed(0)
    return LabNetWithBranch()


def agree(comm, problem) -> None:
    """Every rank's problem found at this point ((check, key, what, hint) or None) is exchanged,
    and every rank raises the first one as a Stop: all ranks stop at the same point (a rank that
    went on alone would wait for the others in its next collective)."""
    every = [pickle.loads(b) for b in gather_bytes(comm, device="cpu", tag="check")(pickle.dumps(problem))]
    first = next((p for p in every if p is not None), None)
    if first is not None:
        raise Stop(*first)


# ------------------------------------------------------------------ the engine the views are graded in


class ViewsEngine(ZeRO1):
    """zl.ZeRO(stage=1) whose optimizer is handed the graded class's views (views_class), checked
    against the closed form of the layout as soon as they are cut, and again once placed."""

    views_class = ParamViewsLab
    script_groups: list = []        # the names in each of the script's groups, in order

    def _place_groups(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.views = self.views_class(self.flat_masters, self.buckets.buckets, self.shards, names)
        self.expected = layout(self.buckets.buckets, self.rank, self.world_size, names)
        agree(self.comm, check_cut(self, names))
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.views.place(self.optimizer)
        agree(self.comm, check_placed(self, names, settings))


def _view_of(engine, p):
    return engine.views.view_of[id(p)]


# ------------------------------------------------------------------ one graded run, on every rank


def measure(plugin) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    ref = reference(n)
    engine = _engine(plugin, build_model())
    params = dict(engine.module.named_parameters())

    def on_pre_step(opt, args, kwargs):     # after the engine's own pre-hook: the views hold their grads
        agree(engine.comm, check_grads(engine, params, ref, step))

    engine.optimizer.register_step_pre_hook(on_pre_step)
    steps = []
    for step in range(len(BRANCH)):
        _train_step(engine, step, rank, n)
        steps.append({"state": local_state(engine, params), "weights": _weights(engine)})
        if step in STATE_DICTS_AT:
            steps[-1]["state_dict"] = _copied(engine.optimizer.state_dict())      # a collective
        engine.optimizer.zero_grad()
    data = {"rank": rank, "n": n, "ref": ref, "steps": steps, "layout": engine.expected,
            "buckets": _pieces(engine), "at": {m: _written_at(plugin["views"], m) for m in SEAMS}}
    data["resumed"] = _resume(plugin, ref, rank, n)
    return data


def _written_at(cls, method: str) -> str:
    """' (lab7_views.py, line 40)' for a method the graded class writes itself; '' for the
    library's own (a planted mistake changes one method and keeps the others)."""
    fn = getattr(cls, method)
    return "" if fn is getattr(ParamViews, method) else defined_at(fn)


def _engine(plugin, model):
    cls = type("Graded", (ViewsEngine,), {"views_class": plugin["views"], "script_groups": group_names(model)})
    return cls(model, optimizer_of(model), bucket_mb=BUCKET_MB)


def _train_step(engine, step, rank, n) -> None:
    engine.module.branch = BRANCH[step]
    loss_of(engine, micro_batch(step, 0, rank, n), 1).backward()
    engine.optimizer.step()


def _resume(plugin, ref, rank, n) -> dict:
    """A new engine at the weights one process had after CHECKPOINT_AFTER loads that process's
    optimizer.state_dict() (a plain PyTorch checkpoint imported) and trains the steps after it.
    If some rank's loaded state is wrong the steps are not run (they could crash in AdamW)."""
    model = build_model()
    model.load_state_dict(ref["weights"][CHECKPOINT_AFTER])
    engine = _engine(plugin, model)
    engine.optimizer.load_state_dict(copy.deepcopy(ref["state_dicts"][CHECKPOINT_AFTER]))
    params = dict(engine.module.named_parameters())
    out = {"loaded": local_state(engine, params), "weights": {}}
    problem = loaded_problem(out["loaded"], engine.expected, ref, rank)
    every = [pickle.loads(b) for b in gather_bytes(engine.comm, device="cpu", tag="check")(pickle.dumps(problem))]
    out["problem"] = next((p for p in every if p is not None), None)
    if out["problem"] is None:
        for step in range(CHECKPOINT_AFTER + 1, len(BRANCH)):
            _train_step(engine, step, rank, n)
            out["weights"][step] = _weights(engine)
            engine.optimizer.zero_grad()
    return out


def local_state(engine, params) -> dict:
    """name -> the optimizer's state for its view on this rank ({} if none), copied."""
    state = engine.optimizer.state
    out = {}
    for name, p in params.items():
        view = _view_of(engine, p)
        entries = state[view] if view in state else {}
        out[name] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in entries.items()}
    return out


def _weights(engine) -> list:
    return [b.data.detach().float().clone() for b in engine.buckets.buckets]


def _pieces(engine) -> list:
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return [Piece(f"bucket {b}", [(names[id(p)], o, k) for p, o, k in zip(bk.params, bk.offsets, bk.sizes)],
                  bk.padded_numel) for b, bk in enumerate(engine.buckets.buckets)]


def _copied(sd: dict) -> dict:
    return {"state": {k: {key: (v.detach().clone() if torch.is_tensor(v) else v) for key, v in st.items()}
                      for k, st in sd["state"].items()},
            "param_groups": copy.deepcopy(sd["param_groups"])}


def reference(n: int) -> dict:
    """One process, the same model, groups and AdamW, on the global batch, step by step:

    names        the parameters in the state dict's positions (the groups, in order)
    grads[s]     name -> its gradient at step s, or None (the side block not taken)
    state[s]     name -> the optimizer's state after step s ({} if never stepped)
    weights[s]   the model's state_dict after step s; before[s] the one before it
    state_dicts  step -> optimizer.state_dict() after it (STATE_DICTS_AT and CHECKPOINT_AFTER)
    """
    model = build_model()
    opt = optimizer_of(model)
    params = dict(model.named_parameters())
    out = {"names": [name for g in group_names(model) for name in g], "grads": [], "state": [], "weights": [],
           "before": [], "state_dicts": {}}
    for step, branch in enumerate(BRANCH):
        out["before"].append({k: v.detach().clone() for k, v in params.items()})
        model.branch = branch
        loss_of(model, global_micro_batch(step, 0, n), 1).backward()
        out["grads"].append({k: None if p.grad is None else p.grad.detach().clone() for k, p in params.items()})
        opt.step()
        out["state"].append({k: {key: v.detach().clone() for key, v in opt.state[p].items()} if p in opt.state
                             else {} for k, p in params.items()})
        out["weights"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if step in STATE_DICTS_AT or step == CHECKPOINT_AFTER:
            out["state_dicts"][step] = _copied(opt.state_dict())
        opt.zero_grad()
    return out


def _lab():
    return Lab(
        name="views", number=7, title="the optimizer handed per-parameter views", chapter="chapter 6, ZeRO-1",
        stub_file="lab7_views.py", world_size=2,
        roles={"views": ParamViewsLab}, reference={"views": ReferenceViews}, measure=measure,
        checks=(Check(VIEWS, None, SECTION, "every parameter's view is the part of it in this rank's slice, in the "
                      "master's memory (whole and shaped, a flat piece, or empty), in the script's group and position"),
                Check(GRADS, None, SECTION, "at every step each view's .grad was its range of the flat gradient, "
                      "in the view's shape and memory; None for an empty view and for the side block when skipped"),
                Check("parity with one process: step counts, moments and weights, parameter by parameter",
                      views_parity.parity, SECTION),
                Check("optimizer.state_dict(): the whole model's, a plain AdamW's", views_parity.state_dict, SECTION),
                Check("a plain PyTorch checkpoint loaded, and the run continued exactly", views_parity.checkpoint,
                      SECTION)),
        mistakes_module="zerolab.labs.views_mistakes",
    )


LAB = _lab()
