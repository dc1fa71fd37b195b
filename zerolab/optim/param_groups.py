"""The script's optimizer, handed to an engine: its groups, its step, its state dict.

A training script builds its optimizer on the model's parameters, often in groups (nanoGPT's
configure_optimizers, Hugging Face's Trainer):

    decay    = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)

An engine takes that optimizer as built (or calls a factory with the model's trainable
parameters: real shapes, real names, so such a rule works as written), or, in FSDP2's order,
adopts one the script builds after wrapping (`await_optimizer`). It checks it (`build`), moves
every parameter of every group onto the tensor the engine really updates for it, in the
group's own order and with the group's hyperparameters, and takes part in its step
(`hand_over`):

* one master per parameter (SingleProcess, NaiveDDP): the parameter itself, or its fp32 copy
  (`place_per_parameter`);
* flat buffers (DDP, ZeRO): the view of the part of the parameter this rank updates
  (optim.param_views), so optimizer.state is per parameter, as PyTorch's is.

From then on optimizer.step() runs the engine's step around the optimizer's own update, through
PyTorch's step hooks (unscale, check, clip and hand each tensor its gradient before; publish
the new weights after), so a learning-rate scheduler, nanoGPT's loop or a course's autograder
drives the engine through the optimizer as written. Under the sharded engines its
state_dict() is the whole model's (a collective) and load_state_dict() takes a whole one.
"""

from __future__ import annotations

import copy
import functools
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .checks import check_built_optimizer, check_optimizer_factory


def build(optimizer, model):
    """(optimizer, its state dict or None): the script's optimizer, checked. `optimizer` is a torch
    optimizer built on the model's parameters (DeepSpeed's "client optimizer"), or a factory the
    engine calls on the model's trainable parameters.

    Refused with a TypeError: an optimizer on tensors that are not this model's parameters, and a
    trainable parameter in no group (a single process would never update it; a flat buffer
    would). An optimizer that already holds state (nanoGPT loads its checkpoint's optimizer state
    before wrapping the model; Adagrad makes its state when built) gives it up here, as a plain
    state dict, and the engine loads it again once the groups hold its own tensors, each rank
    keeping the slice it updates.
    """
    check_optimizer_factory(optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    built = isinstance(optimizer, torch.optim.Optimizer)
    opt = optimizer if built else optimizer(trainable)
    check_built_optimizer(opt)
    mine = {id(p) for p in model.parameters()}
    grouped = set()
    for group in opt.param_groups:
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
            grouped.add(id(p))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in grouped]
    if missing:
        raise TypeError(
            f"{len(missing)} trainable parameter(s) are in none of the optimizer's parameter groups "
            f"(first: {missing[0]!r}). One process would never update them; the engines update flat "
            "buffers. Add them to a group, or freeze them with p.requires_grad_(False) before "
            "building the engine. Two optimizers (Muon on the matrices, AdamW on the rest) are one "
            "to an engine: zl.CombinedOptimizer(muon, adamw).")
    state = None
    if opt.state:
        state = opt.state_dict()
        state["state"] = {k: {key: (v.clone() if torch.is_tensor(v) else v) for key, v in entries.items()}
                          for k, entries in state["state"].items()}
        opt.state.clear()
    return opt, state


def hand_over(opt, engine, state=None) -> None:
    """The engine's optimizer from now on (its groups already hold the engine's tensors). Nothing
    of the optimizer is replaced; the engine takes part through PyTorch's public hooks:

    * opt.step() runs the engine's step around the optimizer's own update, through the step
      hooks: before it, engine._before_update() (refuse a wrong step, unscale, check, clip, give
      each tensor its gradient); after it, engine._after_update() (publish the new weights: a
      cast, an all-gather). So a learning-rate scheduler's wrapper of opt.step, nanoGPT's loop
      and a course's autograder drive the engine as written;
    * opt.zero_grad() is seen by the engine at the next backward or step (the marks it leaves on
      its tensors: zerolab.optim.zero_grad_watch);
    * a group added with add_param_group() is refused at the next step (the buffers are laid out);
    * with per-parameter views (optim.param_views): state_dict() is the whole model's and
      load_state_dict() takes a whole one, through PyTorch's state-dict hooks.

    Each hook holds a weak reference to the engine, so the optimizer never keeps it alive.
    `state`: a state dict the optimizer held before (build), loaded now onto the new tensors."""
    me = weakref.ref(engine)
    opt.register_step_pre_hook(functools.partial(_before_update, me))
    opt.register_step_post_hook(functools.partial(_after_update, me))
    if getattr(engine, "views", None) is not None:
        if engine.sharded:              # (zl.DDP's views are whole: its state dict is already)
            opt.register_state_dict_post_hook(functools.partial(_whole_state, me))
        opt.register_load_state_dict_pre_hook(functools.partial(_this_ranks_state, me))
    if engine.precision.policy.needs_master or engine.sharded or getattr(engine, "bitwise", False):
        # torch.amp.GradScaler (for fp32 weights under autocast) then calls step() itself on
        # every rank, which refuses it by name (Engine._check_step) instead of failing deep
        # inside; sharded: instead of one rank skipping the step (and its collectives) alone
        opt._step_supports_amp_scaling = True
    if state is not None:
        opt.load_state_dict(state)


def _engine_of(me):
    engine = me()
    if engine is None:
        raise RuntimeError("this optimizer belonged to a zerolab engine that no longer exists")
    return engine


def _before_update(me, opt, args, kwargs):
    """optimizer.step(closure)'s pre-hook. torch's contract for a closure: re-evaluate the loss
    (zero_grad, forward, backward) and step on its gradients; so the closure runs here, before
    the engine checks and hands out those gradients, and the optimizer's own call of it returns
    the same loss."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
        args, kwargs = args[:1], {**{k: v for k, v in kwargs.items() if k != "closure"},
                                  "closure": lambda: loss}
    _engine_of(me)._before_update(opt)
    return args, kwargs


def _after_update(me, opt, args, kwargs):
    _engine_of(me)._after_update()


def without_hooks(optimizer):
    """The same optimizer without its step hooks, to run its own update alone (an engine already
    inside its step: offload="disk", one unit at a time). Made by the optimizer's own copy
    protocol (torch.optim.Optimizer.__getstate__): the same defaults, state and parameter groups,
    the same tensors, and none of the hooks."""
    return copy.copy(optimizer)


def run_update(optimizer) -> None:
    """The optimizer's own update, without the engine's part around it."""
    without_hooks(optimizer).step()


def check_no_new_group(opt, groups: int) -> None:
    """Refuse a step after add_param_group(), before anything changes."""
    if len(opt.param_groups) != groups:
        raise RuntimeError("add_param_group() on an engine's optimizer: the engine laid out its buffers "
                           "for the parameters it was built with. Put every parameter group in the "
                           "optimizer before building the engine.")


def _whole_state(me, opt, state_dict):
    """state_dict()'s post-hook: this rank's slices -> the whole model's state (a collective)."""
    engine = _engine_of(me)
    state_dict["state"] = engine.views.consolidate(state_dict["state"], engine.gather_bytes)
    return state_dict


def _this_ranks_state(me, opt, state_dict):
    """load_state_dict()'s pre-hook: a whole state dict -> the slices this rank's views cover."""
    state_dict["state"] = _engine_of(me).views.shard(state_dict["state"], state_dict["param_groups"])
    return state_dict


def place_per_parameter(opt, params, masters) -> None:
    """Each group's parameters -> their masters (the parameters themselves in fp32); a frozen
    parameter keeps its place (it never has a gradient, so it is never stepped)."""
    master_of = {id(p): m for p, m in zip(params, masters)}
    for group in opt.param_groups:
        group["params"] = [master_of.get(id(p), p) for p in group["params"]]


# ------------------------------------------------------------------ FSDP2's order


def await_optimizer(engine) -> None:
    """FSDP2's order: the engine was built without an optimizer, and the script builds one over
    engine.parameters() (or the model's) afterwards. The one public place that sees an optimizer
    the engine was never given is PyTorch's global step pre-hook, which runs before every
    optimizer's step; so the engine registers one for itself, only while it waits. The first step
    of an optimizer over its parameters hands that optimizer to it (engine.adopt: its groups move
    onto the engine's tensors) and removes the hook; this very step is then the engine's (the step
    hooks adopt registers run right after this one). The hook holds a weak reference to the
    engine, and goes with it."""
    me = weakref.ref(engine)
    mine = {id(p) for p in engine.model.parameters()}     # (alive as long as the engine is)

    def adopt_on_first_step(opt, args, kwargs):
        waiting = me()
        if waiting is not None and any(id(p) in mine for g in opt.param_groups for p in g["params"]):
            handle.remove()
            waiting.adopt(opt)

    handle = register_optimizer_step_pre_hook(adopt_on_first_step)
    weakref.finalize(engine, handle.remove)
