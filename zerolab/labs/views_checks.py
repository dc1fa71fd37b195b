"""Lab 7's checks during the run, on every rank (zerolab.labs.views): the views against the closed
form of the layout, each view's gradient, and the state a plain checkpoint loads into.

A wrong view or gradient would make what follows depend on it, or crash inside AdamW, so these
run as the engine cuts and places its views, as each step begins, and after a checkpoint is
loaded. Each returns the problem it finds as (check, key, what, hint), for
zerolab.labs.views.agree to stop every rank with (loaded_problem: (key, what, hint)), or None.
The checks in the parent, over every rank's measurements, are zerolab.labs.views_parity. A state
loaded from a checkpoint is compared exactly (it is the checkpoint's own numbers, cut).
"""

from __future__ import annotations

import torch

from .checks import digits
from .overlap import defined_at
from .views_spec import CHECKPOINT_AFTER, GRADS, VIEWS, dtype_name, span


def _holds(entry, k) -> str:
    """'elements [9, 70) of it (61 of 81)', 'all of it', 'none of it'."""
    _, lo, hi, plo, phi, _ = entry
    if lo == hi:
        return "none of it"
    return "all of it" if phi - plo == k else f"its elements {span(plo, phi)} ({phi - plo} of {k})"


def check_cut(engine, names):
    """The views the graded _cut made, against the layout's closed form (engine.expected)."""
    views = engine.views
    at = defined_at(type(views)._cut)
    r = engine.rank
    for b, bucket in enumerate(engine.buckets.buckets):
        master, s = engine.flat_masters[b], engine.shards[b]
        for p, o, k in zip(bucket.params, bucket.offsets, bucket.sizes):
            name = names[id(p)]
            e = engine.expected[name]
            _, lo, hi, plo, phi, shape = e
            where = (f"{name} lies at {span(o, o + k)} of bucket {b}, and rank {r}'s slice of the bucket is "
                     f"{span(s.start, s.stop)}: rank {r} holds {_holds(e, k)}")
            v = views.view_of.get(id(p))
            if not torch.is_tensor(v):
                return (VIEWS, "no_view", f"after your _cut{at}, self.view_of has no tensor for {name} on rank {r} "
                        f"({where}).", "every parameter of the bucket gets a view: an empty tensor when none of it "
                        "is on this rank.")
            if lo == hi or v.numel() == 0:
                if v.numel() != hi - lo:
                    seen = f"holds {v.numel()} elements" if v.numel() else "is empty"
                    return _range_problem(engine, names, at, f"rank {r}'s view of {name}, as your _cut{at} cut it, "
                                          f"{seen}: {where}.")
                continue
            if v.dtype != master.dtype:
                return (VIEWS, "view_dtype", f"rank {r}'s view of {name}, as your _cut{at} made it, is "
                        f"{dtype_name(v)}; master {b} is {dtype_name(master)}. A view in another dtype is a converted "
                        "copy: the optimizer would update the copy, and the model's weights would never change.",
                        "slice the master as it is (no .half(), .double() or .to()): a view keeps its master's dtype "
                        "and memory.")
            if v.untyped_storage().data_ptr() != master.untyped_storage().data_ptr():
                return (VIEWS, "view_copy", f"rank {r}'s view of {name}, as your _cut{at} made it, is not in the "
                        f"memory of master {b}: it is a copy. The optimizer would update the copy, and the model's "
                        "weights, which the all-gather sends to every rank, would never change.",
                        "index the flat master you are given (and .view() it into a shape): slicing and .view() "
                        "share memory; .clone(), .reshape() of a non-contiguous tensor and torch.tensor() do not.")
            start = v.storage_offset() - master.storage_offset() + s.start - o   # in the parameter
            if (start, start + v.numel()) != (plo, phi):
                return _range_problem(engine, names, at, f"rank {r}'s view of {name}, as your _cut{at} cut it, "
                                      f"covers elements {span(start, start + v.numel())} of the flattened "
                                      f"parameter; {where}.")
            if tuple(v.shape) != shape:
                why = (f"all of {name} lies in rank {r}'s slice, so its view keeps the parameter's own shape, "
                       f"{shape}: the optimizer then sees the very tensor a plain one steps (a whole-matrix "
                       "optimizer the whole matrix, the state dict its state in the parameter's shape)"
                       if phi - plo == k else
                       f"the edge of rank {r}'s slice cuts {name}: its view is the flat piece of {phi - plo} "
                       f"elements, shape {shape}")
                return (VIEWS, "view_shape", f"rank {r}'s view of {name}, as your _cut{at} made it, has shape "
                        f"{tuple(v.shape)}; {why}.", "view the piece in the parameter's shape when it is all of "
                        "the parameter, and leave it flat when it is part of it.")
    return None


def _seen_ranges(engine, names) -> dict | None:
    """name -> (first, end) of the flattened parameter that its view covers on this rank ((0, 0):
    empty), or None if some non-empty view is not in its master's memory."""
    out = {}
    for b, bucket in enumerate(engine.buckets.buckets):
        master, s = engine.flat_masters[b], engine.shards[b]
        for p, o in zip(bucket.params, bucket.offsets):
            v = engine.views.view_of.get(id(p))
            if not torch.is_tensor(v):
                return None
            if v.numel() == 0:
                out[names[id(p)]] = (0, 0)
                continue
            if v.untyped_storage().data_ptr() != master.untyped_storage().data_ptr():
                return None
            start = v.storage_offset() - master.storage_offset() + s.start - o
            out[names[id(p)]] = (start, start + v.numel())
    return out


def _unpadded_ranges(engine, names, first, own_start: bool) -> dict:
    """What each view would cover had the slice been cut from the bucket's REAL size: rank r's
    [first(r, numel), first(r + 1, numel)), sliced out of the master from that start (own_start)
    or from the slice's true start, and clamped to the master as Python's slicing clamps."""
    out, r, n = {}, engine.rank, engine.world_size
    for b, bucket in enumerate(engine.buckets.buckets):
        s, length = engine.shards[b], engine.flat_masters[b].numel()
        start, stop = first(r, bucket.numel, n), first(r + 1, bucket.numel, n)
        shift = start if own_start else s.start
        for p, o, k in zip(bucket.params, bucket.offsets, bucket.sizes):
            lo, hi = max(o, start), min(o + k, stop)
            a, z = max(0, lo - shift), min(length, hi - shift)
            out[names[id(p)]] = (0, 0) if lo >= hi or a >= z else (a + s.start - o, z + s.start - o)
    return out


def _range_problem(engine, names, at, what):
    """The problem for a view that covers the wrong elements: `what` says which and where. Every
    view of this rank is then compared with two mistakes' patterns: each non-empty view one
    element short (the last element inside taken as a slice's end), or every view as a slice
    computed without the padding would give."""
    r, n = engine.rank, engine.world_size
    seen = _seen_ranges(engine, names)
    expected = {name: (e[3], e[4]) if e[1] < e[2] else (0, 0) for name, e in engine.expected.items()}
    short = {name: (a, z - 1) if z - 1 > a else (0, 0) for name, (a, z) in expected.items()}
    if seen is not None and seen == short:
        return (VIEWS, "view_off_by_one", f"{what} Every non-empty view on rank {r} is one element short at its "
                "end: the last element inside the slice was taken as the end of a Python slice, which is excluded.",
                "a parameter at [o, o + n) of the bucket and the slice [start, stop) overlap in "
                "[max(o, start), min(o + n, stop)), ends excluded as in Python's slices: the end is one past the "
                "last element, so no - 1; in the master, whose element 0 is the bucket's element `start`, that "
                "range moves down by `start`.")
    cuts = ((lambda q, numel, n: q * (numel // n)), (lambda q, numel, n: q * numel // n))
    if seen is not None and any(seen == _unpadded_ranges(engine, names, f, own) for f in cuts for own in (True, False)):
        b = next(b for b, bucket in enumerate(engine.buckets.buckets)
                 if any(seen[names[id(p)]] != expected[names[id(p)]] for p in bucket.params))
        bucket, s = engine.buckets.buckets[b], engine.shards[b]
        return (VIEWS, "view_unpadded", f"{what} Bucket {b} holds {bucket.numel} real elements, padded to "
                f"{bucket.padded_numel} ({bucket.padded_numel - bucket.numel} of padding) so that N = {n} divides "
                f"it: each rank's slice is padded_numel / N = {bucket.padded_numel // n} elements, rank {r}'s "
                f"{span(s.start, s.stop)}. Every view on rank {r} is what a slice of the real size, numel // N = "
                f"{bucket.numel // n} elements, would give: the slice was computed without the padding.",
                "cut with the slice you are given, s: its start and stop count the padding (the padded buffer "
                "split N ways, as the reduce-scatter splits it); a slice worked out from the real size moves "
                "every edge once a bucket is padded.")
    return (VIEWS, "view_range", what, "a view covers exactly the elements of its parameter inside the slice: "
            "in the bucket, where the parameter's range and the slice's overlap; in the master, that range "
            "less the slice's start.")


def check_placed(engine, names, settings):
    """The optimizer's groups after the graded place: the script's groups, in order, each
    parameter's view in its place, the groups' hyperparameters kept (settings: before place)."""
    views, opt = engine.views, engine.optimizer
    at = defined_at(type(views).place)
    r = engine.rank
    params = dict(engine.module.named_parameters())
    view_name = {id(views.view_of[id(p)]): n for n, p in params.items() if id(p) in views.view_of}
    groups = opt.param_groups
    hint = ("replace each tensor of each group's \"params\" by its parameter's view, in place: same groups, "
            "same order, nothing else changed.")
    if len(groups) != len(engine.script_groups):
        return (VIEWS, "wrong_place", f"after your place{at}, the optimizer has {len(groups)} parameter groups on "
                f"rank {r}; the script made {len(engine.script_groups)}.", hint)
    position = 0
    for g, (group, want, before) in enumerate(zip(groups, engine.script_groups, settings)):
        changed = [k for k in before if group.get(k) != before[k]]
        if changed:
            return (VIEWS, "wrong_place", f"after your place{at}, parameter group {g} on rank {r} has "
                    f"{changed[0]} = {group.get(changed[0])!r}; the script set {before[changed[0]]!r}.", hint)
        if len(group["params"]) != len(want):
            return (VIEWS, "wrong_place", f"after your place{at}, parameter group {g} holds {len(group['params'])} "
                    f"tensors on rank {r}; the script put {len(want)} parameters in it ({', '.join(want)}).", hint)
        for j, (t, name) in enumerate(zip(group["params"], want)):
            if t is views.view_of.get(id(params[name])):
                position += 1
                continue
            what = (f"the view of {view_name[id(t)]}" if id(t) in view_name else
                    f"the model's own parameter {next(n for n, p in params.items() if p is t)}, not its view"
                    if any(p is t for p in params.values()) else "a tensor that is no parameter's view")
            return (VIEWS, "wrong_place", f"after your place{at}, position {j} of parameter group {g} holds {what} "
                    f"on rank {r}; the script put {name} there. Its view goes there: the group's settings "
                    f"(weight_decay {before.get('weight_decay')}) then apply to it, and the state dict numbers it "
                    f"{position}, as a plain AdamW over the same groups does.", hint)
    return None


def check_grads(engine, params, ref, step):
    """Each view's .grad as the step begins (the graded point_grads ran at the end of backward)."""
    views = engine.views
    at = defined_at(type(views).point_grads)
    r = engine.rank
    names = {id(p): n for n, p in params.items()}
    for b, bucket in enumerate(engine.buckets.buckets):
        flat = engine.flat_masters[b].grad
        for p in bucket.params:
            name = names[id(p)]
            _, lo, hi, plo, phi, shape = engine.expected[name]
            v = views.view_of[id(p)]
            g = v.grad
            head = f"step {step}, rank {r}: the view of {name}"
            if lo == hi:
                if g is not None:
                    return (GRADS, "grad_to_empty", f"{head} is empty (none of {name} is on rank {r}), yet your "
                            f"point_grads{at} gave it a gradient (an empty tensor): the optimizer then steps it, "
                            f"keeps a step count for it and counts steps for elements rank {r} does not hold.",
                            "leave .grad None for an empty view: the optimizer never steps it, and holds no state for it.")
                continue
            if ref["grads"][step][name] is None:
                if g is not None:
                    seen = "zeros" if not bool(g.any()) else "numbers"
                    return (GRADS, "grad_to_skipped", f"{head} was given a gradient ({seen}) by your point_grads{at}, "
                            f"but no rank's backward reached {name} at step {step}: the forward did not take the "
                            "side block. A plain AdamW skips a parameter whose .grad is None: no step counted, "
                            "moments and weight left as they are, no weight decay. Given zeros, AdamW counts a "
                            "step (every later bias correction changes), decays the weight and moves it by its "
                            "momentum.", "`skip` holds the ids of the parameters no rank reached since the last "
                            "zero_grad: leave their views' .grad None.")
                continue
            if g is None:
                return (GRADS, "grad_missing", f"{head} ({phi - plo} of its elements are on rank {r}) has no "
                        f".grad after your point_grads{at}, although the backward reached it: the optimizer "
                        "would skip it, and its elements would not be updated.",
                        "give every non-empty view outside `skip` its range of the master's .grad.")
            if flat is None:
                continue
            want = flat[lo:hi]
            if g.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                if tuple(g.shape) == tuple(v.shape) and torch.equal(g.reshape(-1), want):
                    return (GRADS, "grad_copy", f"{head} holds the right numbers in .grad, but your "
                            f"point_grads{at} gave it a copy, not a view of master {b}'s .grad: the gradient is "
                            "held twice during the step, and whatever the step does to the flat gradient after "
                            "backward (clipping scales it in place) never reaches the copy the optimizer reads.",
                            "index the master's .grad and .view() it in the view's shape: no copy.")
                return (GRADS, "grad_values", f"{head} has a .grad (from your point_grads{at}) that is not its range "
                        f"of master {b}'s gradient, {span(lo, hi)}, nor any view of it.",
                        "the view's .grad is the same range of the master's .grad as the view is of the master.")
            off = g.storage_offset() - flat.storage_offset()
            if (off, off + g.numel()) != (lo, hi):
                return (GRADS, "grad_range", f"{head} covers elements {span(lo, hi)} of master {b}, but the .grad "
                        f"your point_grads{at} gave it is elements {span(off, off + g.numel())} of the master's "
                        "gradient: the optimizer would update each weight with another element's gradient.",
                        "the same range of the master's .grad as the view covers of the master.")
            if tuple(g.shape) != tuple(v.shape):
                return (GRADS, "grad_shape", f"{head} has shape {tuple(v.shape)}, and the .grad your "
                        f"point_grads{at} gave it {tuple(g.shape)}: the optimizer needs the two alike.",
                        ".view() the gradient's range in the view's shape.")
    return None


def loaded_problem(loaded, expected, ref, rank):
    """(key, what, hint) for the state a new engine's optimizer holds right after
    load_state_dict(a plain AdamW's state dict after CHECKPOINT_AFTER), or None."""
    state = ref["state_dicts"][CHECKPOINT_AFTER]["state"]
    head = f"rank {rank}, after optimizer.load_state_dict(a plain AdamW's state dict after step {CHECKPOINT_AFTER})"
    hint = "cut each per-element tensor to the elements the view covers, in the view's shape; keep the scalars."
    # (hints start in lower case: the report prefixes "in your shard (file, line): ")
    for k, name in enumerate(ref["names"]):
        _, lo, hi, plo, phi, shape = expected[name]
        seen, want = loaded[name], state.get(k, {})
        if lo == hi or not want:
            if seen:
                why = (f"none of {name} is on rank {rank}" if lo == hi else
                       f"the checkpoint has no state for {name} (never stepped)")
                return ("loaded_for_empty", f"{head}: its optimizer holds {', '.join(seen)} for {name}, but {why}: "
                        "the state dict's memory saving is lost (and it claims steps this rank never took).",
                        "return no entry for a parameter none of whose elements are on this rank.")
            continue
        for key, v in want.items():
            s = seen.get(key)
            if s is None:
                return ("loaded_missing", f"{head}: its optimizer holds no {key!r} for {name} ({phi - plo} of its "
                        f"elements are on rank {rank}); the checkpoint has it.", hint)
            if not (torch.is_tensor(v) and v.dim() > 0):
                if float(s) != float(v):
                    return ("loaded_scalar", f"{head}: {key} of {name} is {float(s):g}; the checkpoint's is "
                            f"{float(v):g}.", "keep the scalars as they are.")
                continue
            if tuple(s.shape) != shape:
                if tuple(s.shape) == tuple(v.shape):
                    return ("loaded_whole", f"{head}: its optimizer holds the whole of {name}'s {key}, shape "
                            f"{tuple(v.shape)}, where its view on rank {rank} is {shape}, {_holds(expected[name], v.numel())}: "
                            "the next step would fail, or every rank would keep the whole model's state.", hint)
                return ("loaded_shape", f"{head}: {key} of {name} has shape {tuple(s.shape)}; its view is {shape}.", hint)
            flat = v.reshape(-1)
            if not torch.equal(s.reshape(-1).to(v.dtype), flat[plo:phi]):
                n = phi - plo
                mine = s.reshape(-1).to(v.dtype)
                for low in (torch.float16, torch.bfloat16):
                    if torch.equal(mine, flat[plo:phi].to(low).to(v.dtype)):
                        j = int((mine != flat[plo:phi]).nonzero()[0])
                        got, was = digits(float(mine[j]), float(flat[plo + j]))
                        return ("loaded_rounded", f"{head}: {key} of {name} holds the checkpoint's elements "
                                f"{span(plo, phi)}, the ones its view on rank {rank} covers, rounded to "
                                f"{str(low).replace('torch.', '')}: element {plo + j} is {got} where the "
                                f"checkpoint's is {was}. Torch loads a state tensor in its parameter's dtype, "
                                f"{str(v.dtype).replace('torch.', '')}, but the bits the cast dropped do not come "
                                "back.", "cut the tensors as they are (slicing and reshape keep the dtype): no "
                                ".half(), .to() or torch.tensor(..., dtype=...) on the way.")
                found = next((j for j in range(flat.numel() - n + 1) if torch.equal(s.reshape(-1), flat[j:j + n])), None)
                seen_at = (f"elements {span(found, found + n)} of the checkpoint's" if found is not None
                           else "numbers that are no range of the checkpoint's")
                return ("loaded_values", f"{head}: {key} of {name} holds {seen_at} {key}; its view on rank {rank} "
                        f"covers elements {span(plo, phi)} of the parameter.",
                        "cut the range the view covers in the flattened parameter, not from its start.")
    return None
