"""Parameter groups: the optimizer a script builds, moved onto the tensors an engine updates.

A training script builds its optimizer on the model's parameters, often in groups (nanoGPT's
configure_optimizers, Hugging Face's Trainer):

    decay    = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)

So an engine takes that optimizer as built (or calls a factory with the model's trainable
parameters: real shapes, real names, so such a rule works as written), checks it (`build`),
moves every group onto the tensors the engine really updates, keeping each group's
hyperparameters, and makes the optimizer's step() and zero_grad() the engine's (`hand_over`):

* one master per parameter (SingleProcess, NaiveDDP): the parameter itself, or its fp32 copy
  (`place_per_parameter`);
* flat tensors (DDP, ZeRO): inside each bucket the parameters are ordered by group
  (`order_by_group`), so each group's part of a bucket, and of every rank's slice of it, is ONE
  contiguous range, and the group gets a view of that range (`GroupViews`). The optimizer then
  sees one tensor per (bucket, group) instead of one per bucket: the same elementwise
  arithmetic, with each element's own group's weight decay and learning rate. Megatron-LM's
  distributed optimizer maps its groups onto shard ranges the same way. With one group nothing
  is cut: the optimizer updates the flat tensors themselves.
"""

from __future__ import annotations

import types
import weakref

import torch


def build(optimizer, model, precision: str, flat_engine: str | None = None):
    """(optimizer, group_of): the script's optimizer, checked. `optimizer` is a torch optimizer
    built on the model's parameters (DeepSpeed's "client optimizer"), or a factory the engine calls
    on the model's trainable parameters.

    group_of maps id(parameter) -> index of its group. Refused with a TypeError: an optimizer on
    tensors that are not this model's parameters, a trainable parameter in no group (a single
    process would never move it; flat tensors would), and an optimizer that already holds state.
    """
    from .setup import check_built_optimizer, check_optimizer_factory
    check_optimizer_factory(optimizer, precision, flat_engine)
    trainable = [p for p in model.parameters() if p.requires_grad]
    built = isinstance(optimizer, torch.optim.Optimizer)
    opt = optimizer if built else optimizer(trainable)
    check_built_optimizer(opt, flat_engine)
    mine = {id(p): n for n, p in model.named_parameters()}
    group_of = {}
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if id(p) not in mine:
                raise TypeError(
                    ("the optimizer holds tensors that are not this model's parameters: build it on "
                     "the parameters of the model you wrap (model.parameters()), not of another copy."
                     if built else
                     "the optimizer factory built an optimizer on tensors that are not this model's "
                     "parameters. The engine calls it with the model's trainable parameters: use its "
                     "argument (e.g. functools.partial(torch.optim.AdamW, lr=3e-4)), or the "
                     "named_parameters() of the model you wrap, not of another copy."))
            if p.requires_grad:
                group_of[id(p)] = g
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        raise TypeError(
            f"{len(missing)} trainable parameter(s) are in none of the optimizer's parameter groups "
            f"(first: {missing[0]!r}). One process would never update them; the engines update flat "
            "tensors. Add them to a group, or freeze them with p.requires_grad_(False) before "
            "building the engine.")
    if opt.state:
        raise TypeError(
            f"the optimizer already holds state for {len(opt.state)} tensor(s) ({type(opt).__name__} "
            "creates it when built, or it was stepped): the engine moves the parameter groups onto "
            "its own tensors, so it needs an optimizer that creates its state at the first step "
            "(SGD, Adam, AdamW, ...). To resume, build a fresh one and load the state with "
            "zl.checkpoint.load(engine, path).")
    return opt, group_of


def hand_over(opt, engine) -> None:
    """The engine's optimizer from now on: opt.step() is engine.step() (unscale, check, clip, the
    update, the all-gather) and opt.zero_grad() is engine.zero_grad(), so a script that keeps its
    optimizer (nanoGPT's loop, a torch.optim.lr_scheduler, a course's autograder) drives the
    engine through it. The engine runs the update itself through the optimizer's class
    (Engine._run_optimizer). Set on the instance, so a scheduler's wrapper of opt.step wraps this."""
    opt._zerolab_engine = weakref.ref(engine)
    opt.step = types.MethodType(_engine_step, opt)
    opt.zero_grad = types.MethodType(_engine_zero_grad, opt)
    opt.add_param_group = types.MethodType(_no_new_group, opt)


def _engine_of(opt):
    engine = opt._zerolab_engine()
    if engine is None:
        raise RuntimeError("this optimizer belonged to a zerolab engine that no longer exists")
    return engine


def _engine_step(opt, closure=None):
    loss = None
    if closure is not None:         # torch's contract: re-evaluate the loss, then update
        with torch.enable_grad():
            loss = closure()
    _engine_of(opt).step()
    return loss


def _engine_zero_grad(opt, set_to_none: bool = True):
    _engine_of(opt).zero_grad(set_to_none)


def _no_new_group(opt, param_group):
    raise RuntimeError("add_param_group() on an engine's optimizer: the engine laid out its buffers "
                       "for the parameters it was built with. Put every parameter group in the "
                       "optimizer before building the engine.")


def order_by_group(params, group_of) -> list:
    """params sorted by group, keeping their order within a group (a stable sort)."""
    return sorted(params, key=lambda p: group_of.get(id(p), 0))


def place_per_parameter(opt, params, masters) -> None:
    """Each group's parameters -> their masters (the parameters themselves in fp32)."""
    master_of = {id(p): m for p, m in zip(params, masters)}
    for group in opt.param_groups:
        group["params"] = [master_of[id(p)] for p in group["params"] if id(p) in master_of]


class GroupViews:
    """The optimizer's tensors on flat masters: one view per (master, group) range.

    masters[i] holds slice shards[i] of the flat bucket buckets[i] (a zerolab.buckets.Bucket
    whose parameters are ordered by group). With one group the optimizer gets the masters
    themselves and `views` is empty.
    """

    def __init__(self, opt, masters, buckets, shards, group_of):
        self.masters = masters
        self.views = []                      # (view, master index, lo, hi) in master coordinates
        if len(opt.param_groups) == 1:
            opt.param_groups[0]["params"] = list(masters)
            return
        per_group = [[] for _ in opt.param_groups]
        for i, (m, bucket, s) in enumerate(zip(masters, buckets, shards)):
            for g, start, end in _group_ranges(bucket, group_of):
                lo, hi = max(start, s.start) - s.start, min(end, s.stop) - s.start
                if lo < hi:
                    view = m.detach()[lo:hi]     # shares the master's storage: updates land in it
                    per_group[g].append(view)
                    self.views.append((view, i, lo, hi))
        for group, tensors in zip(opt.param_groups, per_group):
            group["params"] = tensors

    def point_grads(self) -> None:
        """Before optimizer.step(): each view's gradient is the same range of its master's."""
        for view, i, lo, hi in self.views:
            grad = self.masters[i].grad
            view.grad = None if grad is None else grad[lo:hi]

    def drop_grads(self) -> None:
        for view, *_ in self.views:
            view.grad = None

    def ranges(self, flats, ranges) -> list:
        """(tensor the optimizer holds, lo, hi) for (master index, lo, hi) ranges of `flats`."""
        if not self.views:
            return [(flats[b], lo, hi) for b, lo, hi in ranges]
        out = []
        for b, lo, hi in ranges:
            for view, i, vlo, vhi in self.views:
                if flats[b] is self.masters[i] and max(lo, vlo) < min(hi, vhi):
                    out.append((view, max(lo, vlo) - vlo, min(hi, vhi) - vlo))
        return out

    def segments(self, segments) -> list:
        """Checkpoint segments (master, offset, name, lo, hi) -> the same on the view holding
        them (a parameter is in one group, so its range is inside one view)."""
        if not self.views:
            return segments
        index = {id(m): i for i, m in enumerate(self.masters)}
        out = []
        for t, t_lo, name, lo, hi in segments:
            i = index[id(t)]
            view, _, vlo, _ = next(v for v in self.views if v[1] == i and v[2] <= t_lo < v[3])
            out.append((view, t_lo - vlo, name, lo, hi))
        return out


def _group_ranges(bucket, group_of) -> list:
    """[(group, start, end)] element ranges of a bucket whose parameters are ordered by group."""
    runs = []
    for p, o, n in zip(bucket.params, bucket.offsets, bucket.sizes):
        g = group_of.get(id(p), 0)
        if runs and runs[-1][0] == g and runs[-1][2] == o:
            runs[-1][2] = o + n
        else:
            runs.append([g, o, o + n])
    return [tuple(r) for r in runs]
