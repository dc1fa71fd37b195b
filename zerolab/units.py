"""ZeRO-3's units: the groups of parameters that are gathered, used and released together.

A Unit holds one flat buffer per kind ("train": trainable parameters, with gradients and optimizer
state; "frozen": the rest) and this rank's shard of each. find_units picks them (by default the
children of the model's largest nn.ModuleList / nn.Sequential). zerolab.zero3 gathers a unit just
before its forward and its backward and releases it right after; _InputsGradDone tells it when a
unit's backward is over. A released buffer keeps its shape but its storage is resized to 0
(_storage_free / _storage_alloc): autograd may hold views of it, so the tensor itself must stay.
Resizing a storage is not an operation the CPU allocation tracker sees, so measure_peak counts it.
"""

from __future__ import annotations

from collections import namedtuple

import torch
import torch.nn as nn

from .memory import PeakMemory

Event = namedtuple("Event", "time rank unit state phase")
"""One step of a unit's lifecycle: state is gathering | gathered | in_use | reduce_scatter | released."""


# ------------------------------------------------------------------ finding the units


def find_units(model: nn.Module, units=None):
    """[(name, module)] of the non-root units, and a note when none could be found.

    Default: the children of the model's largest ModuleList / Sequential (by parameters).
    `units` may name modules ("blocks.0") or pass the modules themselves.
    """
    named = dict(model.named_modules())
    if units is not None:
        out = []
        by_id = {id(m): n for n, m in named.items()}
        for u in units:
            if isinstance(u, str):
                if u not in named or u == "":
                    raise ValueError(f"units: no submodule named {u!r} in the model")
                out.append((u, named[u]))
            elif isinstance(u, nn.Module) and id(u) in by_id and u is not model:
                out.append((by_id[id(u)], u))
            else:
                raise ValueError(f"units: {u!r} is not a submodule of the model (nor its name)")
        return out, None
    best, best_size = None, 0
    for name, m in named.items():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and m is not model:
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = name, size
    if best is None:
        return [], (f"ZeRO3: {type(model).__name__} has no nn.ModuleList or nn.Sequential to cut "
                    "into units; the whole model is ONE root unit (gathered whole for forward and "
                    "backward). Pass units=[...] to name submodules as units.")
    return [(f"{best}.{n}", m) for n, m in named[best].named_children()
            if any(True for _ in m.parameters())], None


class Unit:
    """A group of parameters gathered and freed together: one flat buffer per kind.

    `train` holds the trainable parameters (gradients, optimizer state), `frozen` the rest
    (gathered like the others, never reduced, no optimizer state).
    """

    def __init__(self, index, name, module, params):
        self.index, self.name, self.module = index, name, module
        self.params = params            # original parameters, in model.parameters() order
        self.buckets = {}               # "train" / "frozen" -> Bucket
        self.full = {}                  # kind -> the full flat buffer (storage resized to 0 when free)
        self.shard = {}                 # kind -> this rank's shard, compute dtype
        self.handles = {}               # kind -> Handle of an all-gather in flight
        self.gathered = False
        self.grad_full = None           # full gradient while backward produces it
        self.rs_handle = None
        self.reset_backward()

    def reset_backward(self):
        self.n_acc = 0                  # trainable params whose gradient was accumulated
        self.in_backward = False
        self.input_hooks_out = 0        # input-gradient hooks set up in forward ...
        self.input_hooks_in = 0         # ... and fired in backward
        self.reduced = False
        self.used = set()               # positions (in the train bucket) that got a gradient

    @property
    def numel(self):
        return sum(b.padded_numel for b in self.buckets.values())


class _InputsGradDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is finished."""

    @staticmethod
    def forward(ctx, engine, unit, *tensors):
        ctx.engine, ctx.unit = engine, unit
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._on_inputs_grad(ctx.unit)
        return (None, None) + grads


# Resizing a storage is not an aten operation, so the CPU AllocationTracker behind
# PeakMemory cannot see it: the gathered buffers report their own allocations and frees to
# every region opened with measure_peak() (CUDA's allocator sees them without help).
_ACTIVE: list = []


def _note(delta: int, key=None) -> None:
    for tr in _ACTIVE:
        if key is not None and key in tr._live:   # allocated by an op inside the region
            delta = -tr._live.pop(key)
        tr.current += delta
        tr.peak = max(tr.peak, tr.current)


class measure_peak(PeakMemory):
    """PeakMemory that also counts ZeRO-3's gathered buffers (allocated by resizing storage)."""

    def __enter__(self):
        super().__enter__()
        if self._tracker is not None:
            _ACTIVE.append(self._tracker)
        return self

    def __exit__(self, *exc):
        if self._tracker in _ACTIVE:
            _ACTIVE.remove(self._tracker)
        return super().__exit__(*exc)


def _storage_free(t: torch.Tensor):
    st = t.untyped_storage()
    if st.nbytes():
        key = (st.device.type, st.device.index, st.data_ptr())
        nbytes = st.nbytes()
        st.resize_(0)
        _note(-nbytes, key)


def _storage_alloc(t: torch.Tensor):
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)
        _note(nbytes)
