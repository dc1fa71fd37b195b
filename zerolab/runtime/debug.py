"""Finding where a NaN or an infinity first appeared.

A loss of NaN says that something went wrong, not where. `first_nonfinite` runs a forward
pass with a hook on every module and reports the first module (in the order they ran)
whose output holds a NaN or an inf, with the inputs it was given:

    report = zl.debug.first_nonfinite(model, batch_x)
    print(report)       # "blocks.1.attn.proj produced inf (its inputs were finite) ..."
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class NonFiniteReport:
    module: str                 # qualified name, "" for the model itself
    kind: str                   # "nan", "inf" or "nan and inf"
    inputs_finite: bool         # False: the bad values came in from outside the module
    count: int                  # how many output elements are not finite
    numel: int

    def __str__(self):
        where = self.module or "the model itself"
        origin = ("its inputs were finite, so it created them" if self.inputs_finite
                  else "its inputs already held non-finite values")
        return f"{where} produced {self.kind} in {self.count} of {self.numel} output values ({origin})"


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def _kind(tensors):
    nan = any(bool(torch.isnan(t).any()) for t in tensors if t.is_floating_point())
    inf = any(bool(torch.isinf(t).any()) for t in tensors if t.is_floating_point())
    return "nan and inf" if nan and inf else "nan" if nan else "inf" if inf else None


def first_nonfinite(model: torch.nn.Module, *inputs, **kwargs) -> NonFiniteReport | None:
    """Run model(*inputs) without gradients; return the first module whose output is not finite."""
    names = {m: n for n, m in model.named_modules()}
    found: list = []

    def hook(module, args, output):
        if found:
            return
        outs = [t for t in _tensors(output) if t.is_floating_point()]
        kind = _kind(outs)
        if kind:
            bad = sum(int((~torch.isfinite(t)).sum()) for t in outs)
            found.append(NonFiniteReport(names.get(module, "?"), kind, _kind(_tensors(args)) is None,
                                         bad, sum(t.numel() for t in outs)))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    # hooks fire when a module finishes, so a parent fires after its children: the first
    # report is the innermost module that produced the bad values
    return found[0] if found else None
