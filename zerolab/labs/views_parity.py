"""Lab 7's checks in the parent (zerolab.labs.views), over every rank's measurements: the
optimizer's state parameter by parameter, optimizer.state_dict() against a plain AdamW's, and a
plain checkpoint loaded and continued. Tolerances follow zerolab.labs.checks (round-off of other
summation orders). The checks that run during the run, on every rank, are
zerolab.labs.views_checks.
"""

from __future__ import annotations

import torch

from .checks import GRAD_REL, check_weights, digits, expected_seen
from .lab import Wrong
from .views_spec import BRANCH, CHECKPOINT_AFTER, STATE_DICTS_AT, dtype_name, span


def parity(ranks) -> str:
    for step in range(len(BRANCH)):
        for d in ranks:
            ref, at = d["ref"], d["at"]
            for name in ref["names"]:
                _, lo, hi, plo, phi, shape = d["layout"][name]
                seen, want = d["steps"][step]["state"][name], ref["state"][step][name]
                if lo == hi or not want:
                    if seen:
                        raise Wrong("state_not_held", f"after step {step}, rank {d['rank']}'s optimizer holds state for "
                                    f"{name}, which " + ("has no element on this rank" if lo == hi else
                                    "one process's AdamW has never stepped") + ".", "", step)
                    continue
                if not seen:
                    raise Wrong("no_state", f"after step {step}, rank {d['rank']}'s optimizer holds no state for {name} "
                                f"({phi - plo} of its elements are here); one process's AdamW has stepped it.",
                                f"check what your point_grads{at['point_grads']} gives its view.", step)
                if float(seen["step"]) != float(want["step"]):
                    raise Wrong("step_count", f"after step {step}, rank {d['rank']}: the step count of {name} is "
                                f"{float(seen['step']):g}; one process's AdamW has {float(want['step']):g}.",
                                "a parameter without a gradient is skipped, step count included.", step)
                for key in ("exp_avg", "exp_avg_sq"):
                    w, s = want[key].reshape(-1)[plo:phi], seen[key].reshape(-1).float()
                    tol = GRAD_REL * float(w.abs().max()) + 1e-12
                    if s.shape != w.shape:
                        raise Wrong("moments", f"after step {step}, rank {d['rank']}: {key} of {name} holds "
                                    f"{s.numel()} elements; its view covers {span(plo, phi)} of the parameter, "
                                    f"{phi - plo} elements.", "", step)
                    bad = ((s - w).abs() > tol).nonzero()
                    if bad.numel():
                        i = int(bad[0])
                        raise Wrong("moments", f"after step {step}, rank {d['rank']}: {key} of {name}, element "
                                    f"{plo + i} of the parameter, is not one process's: "
                                    f"{expected_seen(w, s, i)}.", "", step)
            for piece, w in zip(d["buckets"], d["steps"][step]["weights"]):
                size = piece.padded // d["n"]
                check_weights(w, piece, ref["weights"][step], ref["before"][step], d["rank"], step,
                              owners=lambda i, size=size: i // size)
    return (f"after every step, every rank's optimizer holds one process's step count and moments for each "
            f"element it updates (the side block's counts {int(ranks[0]['ref']['state'][-1]['side.weight']['step'])}, "
            f"the others' {len(BRANCH)}), and the weights are one process's")


def _wrong_state(d, step, key, what, hint):
    at = d["at"]
    return Wrong(key, f"rank {d['rank']}'s optimizer.state_dict() after step {step}: {what}",
                 f"in your pieces{at['pieces']} and assemble{at['assemble']}: {hint}.", step)


def _wrong_dtype(d, step, k, name, key, s, v):
    """Raise the Wrong for a state tensor of optimizer.state_dict() in another dtype than AdamW's."""
    low = s.dtype in (torch.float16, torch.bfloat16)
    lost = ""
    if low and s.numel() == v.numel():
        diff = (s.reshape(-1).to(v.dtype) != v.reshape(-1)).nonzero()
        if diff.numel():
            i = int(diff[0])
            was, got = digits(float(v.reshape(-1)[i]), float(s.reshape(-1)[i]))
            lost = f" Element {i} is {got} where a plain AdamW's is {was}."
    why = (f"rounded to {dtype_name(s)}'s {8 if s.dtype == torch.bfloat16 else 11} significant bits (float32 has 24), "
           f"and a checkpoint saved from it keeps the rounding for good.{lost}" if low else
           f"{s.element_size()} bytes an element where AdamW keeps {v.element_size()}: the checkpoint grows, for "
           "digits the optimizer never had.")
    raise _wrong_state(d, step, "state_rounded" if low else "state_widened",
                       f"{key} of {name} (position {k}) is {dtype_name(s)}, shape {tuple(s.shape)}; a plain AdamW's is "
                       f"{dtype_name(v)}, the dtype of the parameter and of the pieces every rank sends: {why}",
                       "make each whole tensor in the dtype of the pieces it is made of (torch.zeros(..., "
                       "dtype=piece.dtype)), and cast nothing")


def state_dict(ranks) -> str:
    for step in STATE_DICTS_AT:
        for d in ranks:
            _compare_state_dict(d, step, d["steps"][step]["state_dict"], d["ref"]["state_dicts"][step])
    return (f"after steps {' and '.join(map(str, STATE_DICTS_AT))}, every rank's optimizer.state_dict() is a plain "
            "AdamW's: the same groups, an entry for each parameter stepped, each state whole and in its "
            "parameter's shape, the step counts of each parameter")


def _compare_state_dict(d, step, seen, want) -> None:
    names, layout = d["ref"]["names"], d["layout"]
    if seen["param_groups"] != want["param_groups"]:
        raise _wrong_state(d, step, "state_groups", f"its param_groups are {seen['param_groups']!r}; a plain AdamW's "
                           f"are {want['param_groups']!r}.", "the groups are torch's own: do not change them")
    for k, st in want["state"].items():
        name, got = names[k], seen["state"].get(k, {})
        piece = layout[name][4] - layout[name][3]
        for key, v in st.items():
            s = got.get(key)
            if torch.is_tensor(v) and v.dim() > 0 and torch.is_tensor(s) and s.dtype != v.dtype:
                _wrong_dtype(d, step, k, name, key, s, v)
            if torch.is_tensor(v) and v.dim() > 0 and torch.is_tensor(s) and tuple(s.shape) != tuple(v.shape):
                if s.numel() == piece != v.numel():
                    raise _wrong_state(d, step, "state_slice", f"{key} of {name} (position {k}) has shape "
                                       f"{tuple(s.shape)}: the piece of it rank {d['rank']} holds, presented as the "
                                       f"whole. A plain AdamW's state dict holds it whole, {tuple(v.shape)}.",
                                       "put each parameter's pieces, from every rank, together")
                raise _wrong_state(d, step, "state_shape", f"{key} of {name} (position {k}) has shape {tuple(s.shape)}; "
                                   f"a plain AdamW's is the parameter's, {tuple(v.shape)}.",
                                   "give each whole tensor its parameter's shape")
    missing = [k for k in want["state"] if k not in seen["state"]]
    extra = [k for k in seen["state"] if k not in want["state"]]
    if missing:
        raise _wrong_state(d, step, "state_missing", f"there is no entry for position {missing[0]} "
                           f"({names[missing[0]]}); a plain AdamW has one for every parameter it has stepped.",
                           "an entry for every parameter some rank has stepped, whichever ranks hold it")
    if extra:
        raise _wrong_state(d, step, "state_extra", f"there is an entry for position {extra[0]} ({names[extra[0]]}), "
                           "which no rank has stepped yet (the side block was not taken): a plain AdamW holds none.",
                           "no entry for a parameter no rank has state for")
    for k, st in want["state"].items():
        name, got = names[k], seen["state"][k]
        for key, v in st.items():
            s = got.get(key)
            if not (torch.is_tensor(v) and v.dim() > 0):
                if s is None:
                    raise _wrong_state(d, step, "state_scalar", f"{name} (position {k}) has no {key!r}; a plain "
                                       f"AdamW's is {float(v):g}.", "every piece of a parameter carries its scalars: "
                                       "take them from a piece some rank sent")
                if float(s) != float(v):
                    raise _wrong_state(d, step, "state_scalar", f"{key} of {name} (position {k}) is {float(s):g}; a "
                                       f"plain AdamW's is {float(v):g}.", "the scalars of a parameter are the same in "
                                       "each of its pieces: take one, as it is")
                continue
            if s is None:
                raise _wrong_state(d, step, "state_keys", f"{name} (position {k}) has no {key!r}.",
                                   "keep every entry of the optimizer's state")
            tol = GRAD_REL * float(v.abs().max()) + 1e-12
            bad = ((s.float() - v).abs() > tol).reshape(-1).nonzero()
            if bad.numel():
                i = int(bad[0])
                seen_at = [j for j in range(v.numel()) if float(v.reshape(-1)[j]) == float(s.reshape(-1)[i])]
                mine = layout[name][3:5]
                note = (f"; that value is the plain AdamW's element {seen_at[0]}, so a piece was put where another "
                        "lies" if seen_at and seen_at[0] != i else "")
                raise _wrong_state(d, step, "state_values", f"{key} of {name} (position {k}), element {i} of the "
                                   f"flattened parameter, is not a plain AdamW's: "
                                   f"{expected_seen(v.reshape(-1), s.reshape(-1).float(), i)}{note}. (Rank "
                                   f"{d['rank']}'s view covers its elements {span(*mine)}.)",
                                   "each piece goes where it lies in the flattened parameter: the elements a view "
                                   "covers, [first, end) of the parameter, go to [first, end) of the whole tensor")


def checkpoint(ranks) -> str:
    for d in ranks:
        problem = d["resumed"]["problem"]
        if problem is not None:
            key, what, hint = problem
            raise Wrong(key, what, f"in your shard{d['at']['shard']}: {hint}", CHECKPOINT_AFTER + 1)
    for d in ranks:
        ref = d["ref"]
        for step, weights in d["resumed"]["weights"].items():
            for piece, w in zip(d["buckets"], weights):
                size = piece.padded // d["n"]
                try:
                    check_weights(w, piece, ref["weights"][step], ref["before"][step], d["rank"], step,
                                  owners=lambda i, size=size: i // size)
                except Wrong as exc:
                    raise Wrong("resumed_weights", f"resumed from a plain AdamW's checkpoint after step "
                                f"{CHECKPOINT_AFTER}: {exc.what}", f"the state was loaded as it should: compare "
                                f"what your shard{d['at']['shard']} keeps of each entry with the checkpoint's.",
                                step) from None
    return (f"a plain AdamW's state dict after step {CHECKPOINT_AFTER} loaded into a new engine gives each rank "
            f"the pieces its views cover, and steps {', '.join(str(s) for s in range(CHECKPOINT_AFTER + 1, len(BRANCH)))} "
            "from there end where one process does")
