"""Before zl.checkpoint.load changes anything: does this checkpoint fit this engine, all of it?

zerolab.checkpoint.reader has checked that the files are what the metadata says and that every
field has the right form. What is left depends on the engine that loads it:

    check_fits(engine, reader, own, ...)   # raises CheckpointError, or the load cannot fail

* the model's parameters, shapes and buffers (Reader.check_model), its precision;
* the hyperparameters the load takes (lr, betas, weight decay...), range-checked: a checkpoint
  must not turn lr negative or maximize on. An option that changes what the optimizer computes
  (maximize, amsgrad, nesterov, foreach...) must be the engine's own;
* the optimizer state: the keys and scalars a step of this optimizer creates (learned by
  stepping a copy of it on one element), with finite values, so that no load succeeds and then
  fails at the first step (a missing exp_avg, a step of -1 or "x");
* the loss scaler's and the RNG states: tried on throw-away objects, so that a bad one is
  refused here and not after the weights were overwritten.
"""

from __future__ import annotations

import math
import random

import torch

from .files import CheckpointError


def _finite_number(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.numel() == 1 and x.is_floating_point() and bool(torch.isfinite(x).all())
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _value(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


# hyperparameters: (smallest, largest, whether the ends are allowed); others: finite and >= 0
_RANGES = {"lr": (0.0, math.inf, True), "eps": (0.0, math.inf, False), "weight_decay": (0.0, math.inf, True),
           "momentum": (0.0, 1.0, True), "dampening": (0.0, 1.0, True), "alpha": (0.0, 1.0, True),
           "lr_decay": (0.0, math.inf, True), "initial_accumulator_value": (0.0, math.inf, True)}


def _hyperparameter_problem(key, saved, current):
    """Why `saved` cannot replace the engine's `current` value of hyperparameter `key` (None: it can)."""
    if isinstance(current, bool) or current is None or isinstance(current, str):
        # an option that changes what the optimizer computes, not a rate: the engine's must stand
        if saved != current or type(saved) is not type(current):
            return (f"the engine's optimizer has {key}={current!r}; build it with the checkpoint's options "
                    f"({key}={saved!r}) to load it")
        return None
    if isinstance(current, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(current) or \
                not all(_finite_number(v) and 0.0 <= _value(v) < 1.0 for v in saved):
            return f"must be {len(current)} finite numbers in [0, 1), as the engine's {tuple(current)}"
        return None
    if _finite_number(current):
        if not _finite_number(saved):
            return "must be a finite number"
        low, high, ends = _RANGES.get(key, (0.0, math.inf, True))
        v = _value(saved)
        if not (low <= v <= high if ends else low < v < high):
            return f"must be in {'[' if ends else '('}{low:g}, {high:g}{']' if ends else ')'}"
        return None
    if type(saved) is not type(current):
        return f"must be a {type(current).__name__}, as the engine's"
    return None


def check_param_groups(engine, saved_groups, where) -> None:
    groups = engine.optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"{where}: the optimizer has {len(groups)} param groups, the checkpoint "
                              f"{len(saved_groups)}")
    for i, (group, saved) in enumerate(zip(groups, saved_groups)):
        for key, value in saved.items():
            if key in group and key != "params":
                why = _hyperparameter_problem(key, value, group[key])
                if why:
                    raise CheckpointError(f"{where}: param_groups[{i}][{key!r}] = {value!r}: {why}")


def expected_state(optimizer):
    """(the state keys that hold one value per element, {scalar key: an example}) that one step
    of this optimizer creates, learned by stepping a copy of it on one element; None when it
    cannot be learned: a class outside torch.optim (its step might do anything, a collective
    included), or one that cannot be rebuilt from its hyperparameters."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return None
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    p = torch.zeros(2, requires_grad=True)
    p.grad = torch.full((2,), 1e-3)
    try:
        probe = type(optimizer)([{"params": [p], **group}])
        probe.step()
    except Exception:  # noqa: BLE001 - then only the checks that need no probe are made
        return None
    state = probe.state.get(p, {})
    tensors = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape}
    return tensors, {k: v for k, v in state.items() if k not in tensors}


def _scalar_problem(key, value, example):
    if isinstance(example, torch.Tensor):
        if not (isinstance(value, torch.Tensor) and value.shape == example.shape and value.dtype == example.dtype):
            return f"must be a {example.dtype} tensor of shape {tuple(example.shape)}"
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return "must be finite"
    elif not (_finite_number(value) and type(value) is type(example)):
        return f"must be a finite {type(example).__name__}"
    if key == "step" and not (_value(value) >= 0 and _value(value) == int(_value(value))):
        return "must be a whole number >= 0"
    return None


def check_optimizer_state(engine, reader, opt_segments) -> None:
    """Every piece the engine's optimizer state will come from holds the state a step of this
    optimizer needs: the same keys in every piece that has state, scalars of the right kind.
    An error names the shard file that holds the piece."""
    expected = expected_state(engine.optimizer)
    seen = None
    for _, _, name, lo, hi in opt_segments:
        for piece, where in reader.pieces_in_files(name, lo, hi):
            keys, scalars = set(piece["state"]), piece["scalars"]
            if not keys and not scalars:
                continue          # never stepped (a parameter without a gradient yet): fresh state
            if expected is not None:
                want_keys, want_scalars = expected
                if keys != want_keys or set(scalars) != set(want_scalars):
                    raise CheckpointError(
                        f"{where}: the optimizer state of {name!r} holds {sorted(keys | set(scalars))}; "
                        f"a step of {type(engine.optimizer).__name__} needs {sorted(want_keys | set(want_scalars))}")
                for key, value in scalars.items():
                    why = _scalar_problem(key, value, want_scalars[key])
                    if why:
                        raise CheckpointError(f"{where}: optimizer state {key!r} of {name!r} = {value!r}: {why}")
            elif seen is not None and (keys, set(scalars)) != seen:
                raise CheckpointError(f"{where}: the optimizer state of {name!r} holds {sorted(keys | set(scalars))}, "
                                      f"another piece's {sorted(seen[0] | seen[1])}")
            seen = (keys, set(scalars))


def check_precision_state(engine, state, where) -> None:
    """The loss scaler's state, loaded into a throw-away scaler first."""
    from ..precision import LossScaler
    scaler = state.get("scaler")
    if engine.precision.scaler is None or scaler is None:
        if engine.precision.scaler is not None:
            raise CheckpointError(f"{where}: the engine scales its fp16 loss, the checkpoint holds no scaler state")
        return
    counters = ("good_steps", "overflows_left", "skipped", "skipped_in_a_row")
    try:
        if not isinstance(scaler, dict) or not all(isinstance(scaler.get(k), int) and not isinstance(scaler[k], bool)
                                                   and scaler[k] >= 0 for k in counters):
            raise ValueError(f"{', '.join(counters)} must be ints >= 0")
        LossScaler().load_state_dict(scaler)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        raise CheckpointError(f"{where}: the loss scaler's state is not valid ({str(e)[:200]})") from None


def check_rng_state(state, where) -> None:
    """The RNG states, set on throw-away generators first."""
    try:
        torch.Generator().set_state(state["torch"])
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        if "cuda" in state and not (isinstance(state["cuda"], torch.Tensor) and state["cuda"].dtype == torch.uint8):
            raise ValueError("the CUDA RNG state must be a uint8 tensor")
    except (ValueError, TypeError, RuntimeError, KeyError, IndexError, OverflowError) as e:
        raise CheckpointError(f"{where}: the RNG states are not valid ({str(e)[:200]})") from None


def check_fits(engine, reader, own: int, opt_segments, restore_rng: bool) -> None:
    """Everything zl.checkpoint.load will take from `reader` (this rank's shard is shard `own`),
    checked against `engine` before anything changes; raises CheckpointError naming the file that
    holds what is wrong: the metadata for the model and its precision, a shard for the values."""
    reader.check_model(engine.model)
    reader.check_all()
    if reader.meta["precision"] != engine.precision.name:
        raise CheckpointError(f"{reader.meta_path}: saved with precision {reader.meta['precision']!r}, "
                              f"the engine uses {engine.precision.name!r}")
    info, where = reader.shard(own), reader.shard_path(own)
    check_param_groups(engine, info["param_groups"], where)
    check_optimizer_state(engine, reader, opt_segments)
    check_precision_state(engine, info["precision"], where)
    if restore_rng:
        check_rng_state(info["rng"], where)
