"""What the engine labs' checks share: comparing what a rank holds with one process on the global
batch, recognising the wrong answers that mistakes produce, and the closed forms of bytes.

Gradients and weights are compared as FLAT pieces laid out as the engine lays them out (a bucket,
a rank's slice of one, a ZeRO-3 unit): a Piece names its parameters and where they sit, so a
message can say "rank 1, step 0, bucket 2 (blocks.1.lin.weight, elements 41-81)".

Tolerances. A correct engine adds the same numbers as one process in another order, so its
gradients differ by round-off: a few units in the last place of the largest terms, about 1e-7 of
the largest gradient element on this model. GRAD_REL = 1e-4 of it leaves a thousandfold margin,
and every mistake below is off by a sizeable fraction of the gradient itself. The weights after
AdamW steps follow tests/tolerances.py: Adam turns a round-off dg into an update change of at
most about lr * dg / eps per step, measured below ADAM_ROUNDOFF_STEP on such models, so two
correct runs differ by at most 2 * steps * ADAM_ROUNDOFF_STEP (tests/test_labs.py checks both
constants against tests/tolerances.py and the premise on this model); a mistake moves a weight by
about lr = 1e-3 per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lab import Wrong
from .model import SCHEDULE

GRAD_REL = 1e-4
ADAM_ROUNDOFF_STEP = 3e-6       # the premise of tests/tolerances.py (the lab model is checked too)
PARITY = "parity with one process on the global batch"     # (labs 3 to 6: the check's title)
# collectives the library runs for its own bookkeeping, not to move gradients or parameters
BOOKKEEPING = {"used", "check", "overflow", "grad_norm", "setup", "buffers", "state"}


def weight_tol(steps: int) -> float:
    """How far a correct engine's weights may be from one process's after `steps` AdamW steps."""
    return 2 * steps * ADAM_ROUNDOFF_STEP


@dataclass
class Piece:
    """A flat piece of an engine's layout: `label` ("bucket 2", "unit blocks.0"), `entries`
    [(parameter name, offset, size)] in the full padded buffer, `padded` its length, and `lo`,
    `hi` the part this rank holds (a ZeRO slice; the whole buffer for DDP)."""

    label: str
    entries: list
    padded: int
    lo: int = 0
    hi: int | None = None

    def __post_init__(self):
        if self.hi is None:
            self.hi = self.padded

    def flat(self, by_name: dict) -> torch.Tensor:
        """The part [lo, hi) of the padded buffer filled from per-parameter tensors (padding: 0)."""
        full = torch.zeros(self.padded)
        for name, offset, size in self.entries:
            full[offset:offset + size] = by_name[name].reshape(-1).float()
        return full[self.lo:self.hi]

    def where(self, i: int) -> str:
        """'blocks.1.lin.weight, element 40' for index i of the held part (or 'padding')."""
        at = self.lo + i
        for name, offset, size in self.entries:
            if offset <= at < offset + size:
                return f"{name}, element {at - offset}"
        return f"padding, element {at} of the bucket"


def adam_state_bytes(pieces, n: int, rank: int) -> int:
    """What AdamW holds on `rank` when the optimizer is handed this rank's part of each parameter
    (zerolab.optim.param_views): two fp32 moments per real element of its slice of each padded
    piece (K = 8 bytes; padding has none) and a 4-byte step count per parameter with a part in it."""
    total = 0
    for piece in pieces:
        size = piece.padded // n
        lo, hi = rank * size, (rank + 1) * size
        for _, offset, numel in piece.entries:
            mine = min(offset + numel, hi) - max(offset, lo)
            if mine > 0:
                total += 8 * mine + 4
    return total


def piece_of_bucket(label, bucket, names, lo=0, hi=None) -> Piece:
    """A Piece for a zerolab.buckets.Bucket (names: id(param) -> its name)."""
    return Piece(label, [(names[id(p)], o, n) for p, o, n in zip(bucket.params, bucket.offsets, bucket.sizes)],
                 bucket.padded_numel, lo, hi)


def _close(seen, wanted) -> bool:
    tol = GRAD_REL * float(wanted.abs().max()) + 1e-12
    return seen.shape == wanted.shape and bool(((seen - wanted).abs() <= tol).all())


# The wrong answers a reduction gives, in the words of chapters 5 to 8. Each: (key, test, what it
# is, what to do). `c` holds the candidates: expected (the global batch's gradient), local (this
# rank's own), last_micro (the step's last micro-batch only), previous (last step's expected),
# and n, the number of ranks.
WRONG_GRADIENTS = (
    ("zeros", lambda s, c: bool((s == 0).all()) and bool((c["expected"] != 0).any()),
     "zeros: no gradient arrived there",
     "check that the reduction's result is written where the step reads it."),
    ("not_divided", lambda s, c: _close(s, c["n"] * c["expected"]),
     "N = {n} times the mean: the SUM over ranks, never divided by N",
     "gloo has no average: divide the buffer by N just before its collective, so the sum is the mean."),
    ("divided_twice", lambda s, c: _close(s, c["expected"] / c["n"]),
     "the mean divided by N once more",
     "divide by N once, before the collective."),
    ("not_reduced", lambda s, c: _close(s, c["local"]),
     "this rank's own gradient: it was never averaged with the other ranks'",
     "the averaged gradient is the collective's result: make sure that is what ends up there."),
    ("divided_not_reduced", lambda s, c: _close(s, c["local"] / c["n"]),
     "this rank's own gradient divided by N: divided, but the collective's result is not there",
     "wait for the collective and keep its result."),
    ("added_to_local", lambda s, c: (_close(s, c["local"] + c["expected"])
                                     or _close(s, c["local"] / c["n"] + c["expected"])),
     "this rank's own gradient (divided by N or not) PLUS the mean: the collective's result was "
     "added to what was there",
     "the result replaces the buffer's content (copy it in), it does not add to it."),
    ("not_reset", lambda s, c: c["previous"] is not None and _close(s, c["expected"] + c["previous"]),
     "this step's mean PLUS the last step's: the buffer still held the last step's gradient",
     "a step's FIRST gradient is copied into its slot; only later micro-batches add to it. "
     "zero_grad() sets p.grad to None but the buckets keep their old values."),
    ("lost_micro_batch", lambda s, c: c["last_micro"] is not None and _close(s, c["last_micro"]),
     "the last micro-batch's gradient only: the first one's was overwritten",
     "a later micro-batch must ADD to what the earlier ones left."),
)


def explain_gradient(seen, cand) -> tuple:
    """(key, what it is, what to do) for a wrong gradient `seen`, given the candidates."""
    for key, test, what, hint in WRONG_GRADIENTS:
        if test(seen, cand):
            return key, what.format(n=cand["n"]), hint
    return ("wrong", "not the mean of the ranks' gradients, nor any answer the grader knows",
            "compare your code with the chapter's description, one step at a time.")


def check_gradient(seen, piece: Piece, cand_by_name: dict, n: int, rank: int, step: int, what: str):
    """Raise Wrong if a rank's flat gradient `seen` (piece's part) is not the global batch's.
    cand_by_name: expected, local, last_micro, previous (dicts name -> tensor, or None)."""
    cand = {k: (None if v is None else piece.flat(v)) for k, v in cand_by_name.items()}
    cand["n"] = n
    wanted = cand["expected"]
    seen = seen.detach().reshape(-1).float()
    if _close(seen, wanted):
        return
    key, is_what, hint = explain_gradient(seen, cand)
    tol = GRAD_REL * float(wanted.abs().max())
    bad = int(((seen - wanted).abs() > tol).nonzero()[0]) if seen.shape == wanted.shape else 0
    at = piece.where(bad) if seen.shape == wanted.shape else f"{seen.numel()} elements, expected {wanted.numel()}"
    raise Wrong(key, f"step {step}, rank {rank}, {piece.label}: {what} is {is_what}. First wrong element: "
                     f"{at}: {expected_seen(wanted, seen, bad)}.", hint, step)


def digits(a: float, b: float) -> tuple:
    """a and b as text, to the digits where they differ: 3 significant digits, and more until the
    two texts differ (up to 17, every digit of a float64), so that 0.000123456 and 0.000123457 are
    not both shown as 0.000123."""
    for n in range(3, 18):
        sa, sb = f"{a:.{n}g}", f"{b:.{n}g}"
        if sa != sb:
            break
    return sa, sb


def expected_seen(wanted, seen, i) -> str:
    """'expected 0.0123456, seen 0.0123462' for element i of two flat tensors."""
    if i >= seen.numel():
        return f"expected {float(wanted[i]):.3g}, seen nothing (the tensor has {seen.numel()} elements)"
    w, s = digits(float(wanted[i]), float(seen[i]))
    return f"expected {w}, seen {s}"


def check_weights(seen, piece: Piece, expected: dict, before: dict, rank: int, step: int, owners=None):
    """Raise Wrong if the weights `seen` (piece's part) are not one process's after step `step`.
    before: the weights before that step; owners(i) -> the rank that updates element i (ZeRO)."""
    wanted = piece.flat(expected)
    seen = seen.detach().reshape(-1).float()
    err = (seen - wanted).abs()
    tol = weight_tol(step + 1)
    if bool((err <= tol).all()):
        return
    bad = int((err > tol).nonzero()[0])
    old = piece.flat(before)
    stale = (seen - old).abs() <= tol
    owner = "" if owners is None else f" (rank {owners(bad)} updates it)"
    old_text, wanted_text = digits(float(old[bad]), float(wanted[bad]))
    seen_text, wanted_text2 = digits(float(seen[bad]), float(wanted[bad]))
    if bool(stale[bad]):
        own = owners is not None and owners(bad) == rank
        # this rank's OWN element unchanged: its optimizer never wrote into the model's weights
        # (a copy was updated); another rank's: that rank's update never arrived (no all-gather)
        hint = ("this rank's own slice did not change, so the optimizer updated a tensor that is not "
                "the model's: the tensor it steps (master_shards[b]) must be a view of bucket.data "
                "(in fp32), or be copied back into it after the step." if own else
                "after the optimizer updates its slice, every rank must get every slice: all-gather "
                "the parameters.")
        raise Wrong("not_updated_own" if own else "not_updated",
                    f"after step {step}, rank {rank}'s weights in {piece.label} are not "
                    f"updated: {piece.where(bad)}{owner} still holds its value from before the step "
                    f"({old_text}; one process has {wanted_text}).", hint, step)
    raise Wrong("weights", f"after step {step}, rank {rank}'s weight {piece.where(bad)} in {piece.label}{owner} is "
                f"{seen_text}; one process on the global batch has {wanted_text2} (tolerance "
                f"{tol:.0e}).", "the gradients were right, so look at what happens after backward.", step)


# ------------------------------------------------------------------ bytes


def ring_factor(op: str, n: int) -> float:
    """The share of the full tensor each rank sends in a ring (zerolab.runtime.comm)."""
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}[op]


def fmt_bytes(b: float) -> str:
    return f"{b:,.0f} B"


def by_op(calls) -> str:
    """'reduce_scatter: 6 calls, 844 B; all_gather: 6 calls, 844 B' for [(op, numel, bytes, ...)]."""
    ops = {}
    for op, numel, sent, *_ in calls:
        c = ops.setdefault(op, [0, 0])
        c[0] += 1
        c[1] += sent
    return "; ".join(f"{op}: {c} call{'s' * (c != 1)}, {fmt_bytes(b)}" for op, (c, b) in ops.items()) or "nothing"


def check_collectives(rank: int, step: int, seen: list, wanted: list, n: int, formula: str):
    """Raise Wrong unless the collectives that moved gradients and parameters in a step, `seen`
    [(op, numel, bytes, tag)], are `wanted` [(op, numel)] (in any order)."""
    if sorted((op, numel) for op, numel, *_ in seen) == sorted(wanted):
        return
    want = [(op, numel, round(ring_factor(op, n) * 4 * numel)) for op, numel in wanted]
    key, hint = "bytes", "compare the collectives you issue with the chapter's, one per bucket or unit."
    if any(op == "all_reduce" for op, *_ in seen) and not any(op == "all_reduce" for op, _ in wanted):
        key, hint = ("all_reduce", "a reduce-scatter gives each rank only its own slice of the sum, and "
                     "sends (N-1)/N of the buffer; an all-reduce sends twice that, to give every rank "
                     "slices it then throws away.")
    raise Wrong(key, f"step {step}, rank {rank}: the gradients and parameters moved by {by_op(seen)} "
                     f"({fmt_bytes(sum(x[2] for x in seen))}); expected {by_op(want)} "
                     f"({fmt_bytes(sum(x[2] for x in want))}): {formula}.", hint, step)


def candidates(ref: dict, step: int) -> dict:
    """What check_gradient compares a rank's gradient with at `step` (model.reference)."""
    return {"expected": ref["expected"][step], "local": ref["local"][step],
            "last_micro": ref["last_micro"][step] if SCHEDULE[step] > 1 else None,
            "previous": ref["expected"][step - 1] if step > 0 else None}


def check_parity(ranks: list, weight_pieces: str, what, sharded: bool,
                 no_grad_hint: str = "every gradient must be where the step reads it.", hints=None) -> None:
    """Step by step, every rank's gradients (data["pieces"], after backward) and then every rank's
    weights (data[weight_pieces], after the step) against one process on the global batch.
    what(piece) names the gradient held ("p.grad of out.bias", "the owned gradient"). A step may
    keep "full": per piece, the whole padded gradient buffer, where a result written into another
    rank's slice is looked for (ZeRO-1)."""
    for step in range(len(ranks[0]["steps"])):
        for d in ranks:
            cand = candidates(d["ref"], step)
            full = d["steps"][step].get("full")
            for j, (piece, g) in enumerate(zip(d["pieces"], d["steps"][step]["held"])):
                if g is None:
                    raise Wrong("no_grad", f"step {step}, rank {d['rank']}, {piece.label}: {what(piece)} is "
                                "None after backward.", no_grad_hint, step)
                try:
                    check_gradient(g, piece, cand, d["n"], d["rank"], step, what(piece))
                except Wrong as exc:
                    if full is not None:
                        _result_elsewhere(full[j], piece, cand, d, step, what(piece))
                    if hints and exc.key in hints:
                        exc.hint = hints[exc.key]
                    raise exc
        for d in ranks:
            for piece, w in zip(d[weight_pieces], d["steps"][step]["weights"]):
                size = piece.padded // d["n"]
                check_weights(w, piece, d["ref"]["weights"][step], d["ref"]["before"][step], d["rank"], step,
                              owners=(lambda i, size=size: i // size) if sharded else None)


def _result_elsewhere(full, piece: Piece, cand: dict, d: dict, step: int, what: str) -> None:
    """Raise Wrong if this rank's slice of the reduced gradient (the mean of slice r) sits in the
    whole buffer `full` at another rank's slice instead of its own."""
    whole = Piece(piece.label, piece.entries, piece.padded)
    wanted = whole.flat(cand["expected"])[piece.lo:piece.hi]
    size = piece.hi - piece.lo
    full = full.detach().reshape(-1).float()
    for q in range(d["n"]):
        lo = q * size
        if lo != piece.lo and _close(full[lo:lo + size], wanted):
            raise Wrong("result_elsewhere",
                        f"step {step}, rank {d['rank']}, {piece.label}: {what}, elements {piece.lo}-{piece.hi} of the "
                        f"bucket's gradient, is not the mean of that slice; the mean of that slice is at elements "
                        f"{lo}-{lo + size} instead, rank {q}'s slice: the reduce-scatter's result was written at the "
                        f"wrong offset.",
                        "rank r's result goes into slice r of the bucket's gradient (self.shards[b]), where the step "
                        "reads it.", step)


def per_step(ranks: list, check) -> None:
    """check(step, rank's data, its step's data), step by step and, within a step, rank by rank. A
    Wrong it raises carries its step: the report explains the earliest thing wrong in the run."""
    for step in range(len(ranks[0]["steps"])):
        for d in ranks:
            try:
                check(step, d, d["steps"][step])
            except Wrong as exc:
                exc.step = step if exc.step is None else exc.step
                raise
