"""What an engine checks of the optimizer it is given, before it touches the model.

An engine takes a torch optimizer built on the model's parameters (DeepSpeed's "client
optimizer"), or a factory it calls on them (functools.partial(torch.optim.AdamW, lr=3e-4)).
Anything else is refused here, in one line that says what to pass; so is an optimizer that
needs a closure at every step (LBFGS), which an engine's step never has. Which tensors the
optimizer holds is checked once it is built (zerolab.optim.param_groups.build).
"""

from __future__ import annotations

import torch


def optimizer_class(optimizer):
    """The class behind an optimizer, its class, or a functools.partial of it (else None)."""
    kind = optimizer if isinstance(optimizer, type) else (
        type(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else getattr(optimizer, "func", None))
    return kind if isinstance(kind, type) else None


def check_no_closure(optimizer) -> None:
    kind = optimizer_class(optimizer)
    if kind is not None and issubclass(kind, torch.optim.LBFGS):
        raise TypeError(f"{kind.__name__} needs a closure that re-evaluates the loss at every step; zerolab "
                        "engines call optimizer.step() once per step, without one. Use a first-order "
                        "optimizer (SGD, Adam, AdamW, ...).")


def check_optimizer_factory(optimizer) -> None:
    """Refuse anything but a torch optimizer or a factory of one, before an engine touches the
    model. (A built optimizer's tensors and state are checked by param_groups.build.)"""
    if not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        raise TypeError(f"optimizer must be a torch optimizer built on the model's parameters, or a "
                        f"callable params -> torch.optim.Optimizer such as "
                        f"functools.partial(torch.optim.AdamW, lr=3e-4); got {optimizer!r}")
    check_no_closure(optimizer)


def check_built_optimizer(opt) -> None:
    """What a factory returned: a torch optimizer that needs no closure."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    check_no_closure(opt)


def check_no_optimizer(engine_name: str, precision: str, max_grad_norm) -> None:
    """zl.DDP(model) / zl.NaiveDDP(model) without an optimizer, as DistributedDataParallel: the
    script's own optimizer steps the model's parameters, so there are no masters to keep."""
    if precision != "fp32":
        raise ValueError(
            f"{engine_name} without an optimizer trains in fp32 only: precision={precision!r} keeps "
            "fp32 master weights that the engine's optimizer updates. Pass an optimizer (built on "
            "model.parameters(), or a factory), or keep precision='fp32' and step your own.")
    if max_grad_norm is not None:
        raise ValueError(
            f"{engine_name} without an optimizer has no step to clip in: call "
            "torch.nn.utils.clip_grad_norm_(engine.parameters(), max_norm) before your optimizer's "
            "step (p.grad holds the averaged gradients), or pass an optimizer.")


def build_optimizer(optimizer, params) -> torch.optim.Optimizer:
    """Call an optimizer factory on `params` (a chapter's own engine; the engines build theirs
    with zerolab.optim.param_groups.build, which also honours parameter groups)."""
    check_optimizer_factory(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("this engine takes an optimizer factory, e.g. functools.partial(torch.optim.AdamW, lr=3e-4)")
    opt = optimizer(params)
    check_built_optimizer(opt)
    if {id(p) for group in opt.param_groups for p in group["params"]} != {id(t) for t in params}:
        raise TypeError("the optimizer factory built an optimizer on other tensors than the ones it "
                        "was given: use its argument, e.g. functools.partial(torch.optim.AdamW, lr=3e-4).")
    return opt
