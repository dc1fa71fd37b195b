"""Lab 2: a dynamic loss scaler with skip, back-off and growth, agreed over ranks (chapter 2).

The student writes two methods of zerolab.precision, the ones chapter 2 describes:

    LossScaler.update(found_inf, step)        the scale's rules: skip, back off after `hysteresis`
                                              overflows in a row (never below min_scale), grow after
                                              growth_interval clean steps, give up when hopeless
    MixedPrecision.unscale_and_check(grads)   divide the gradients by the scale; True if EVERY rank's
                                              are finite (one all-reduce), so all skip or step together

The rules are graded on patterns of overflows against independent references: torch's own
GradScaler (with hysteresis=1 zerolab's rule is GradScaler's) and a trajectory worked out by hand
from the rules. Then ZeRO-1 trains in fp16 on 2 ranks with the student's classes plugged in, and
rank 1 plants an inf in a gradient that only rank 0's slice holds: the ranks must still agree.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist

from ..book.scaler_rules import gradscaler_trajectory
from ..engines.zero1 import ZeRO1                 # the engine the scaler is graded in
from ..precision import LossScaler, MixedPrecision  # the library's: the reference
from .engine_run import stub
from .lab import Check, Lab, Stop, Wrong
from .model import build, loss_of, micro_batch, global_micro_batch

AGREE = "every rank skips the same steps"

# growth_interval=3, hysteresis=2: "x" marks a step whose gradients overflowed
PATTERN = "...x.xx..x......xxxx"
RULES = dict(init_scale=2.0**10, growth_interval=3, hysteresis=2, min_scale=1.0, max_skips=10)
# log2 of the scale after each step, worked out by hand from chapter 2's rules:
#   s2 grows (3 clean steps); s3 one overflow, tolerated; s4 clean: the count is refilled; s5, s6
#   two in a row: back off; s9 tolerated, and it restarts the clean count, so s12 grows, and s15;
#   s16-s19 four in a row: back off at s17 (which refills the count) and again at s19
EXPECTED_LOG2 = [10, 10, 11, 11, 11, 11, 10, 10, 10, 10, 10, 10, 11, 11, 11, 12, 12, 11, 11, 10]
GIVE_UPS = {   # name -> (settings, pattern, the step at which it must raise: None, never)
    "at min_scale": (dict(init_scale=2.0**8, min_scale=2.0**7, hysteresis=1, growth_interval=100), "xx", 1),
    "after max_skips": (dict(init_scale=2.0**20, hysteresis=1, max_skips=3, growth_interval=100), "xxxx", 2),
    "not for skips apart": (dict(init_scale=2.0**20, hysteresis=1, max_skips=3, growth_interval=100), "xx.xx.xx",
                            None),
}
SCALED = dict(init_scale=2.0**8, growth_interval=2)   # the training run's scaler
INF_STEP, STEPS, LR = 1, 4, 0.1
# fp16 gradients carry a relative rounding of 2^-11 on each of a few terms; SGD moves a weight by
# lr * g with |g| < 0.5 here, so a correct run differs from fp32 by well under 1e-4 per step:
# 3 applied steps, 3e-4 (a correct run measured 4.6e-5 here). A skipped step applied, or a gradient
# not unscaled, moves a weight by about lr |g|, 1e-2.
WEIGHT_TOL = 3e-4


class ScalerLab(LossScaler):
    """zerolab.precision.LossScaler with update() left to write. Its state (set up for you):

    self.scale, self.growth_factor, self.backoff_factor, self.growth_interval, self.hysteresis,
    self.min_scale, self.max_skips     the settings (as LossScaler's docstring describes them)
    self._good_steps        clean steps since the last overflow or growth
    self._overflows_left    overflows still tolerated before backing off (starts at hysteresis)
    self.skipped, self.skipped_in_a_row   counts of skipped steps (in all, and in a row)
    """


class PrecisionLab(MixedPrecision):
    """zerolab.precision.MixedPrecision with unscale_and_check() left to write. What you can use:
    self.scaler (your loss scaler: .scale), self.ledger (the engine's zerolab.runtime.comm.Ledger:
    all_reduce(tensor, op="sum" | "max" | "min", group=...)), self.group (pass it on to the ledger)."""


ScalerLab.update = stub("lab 2", "ScalerLab", "update")
PrecisionLab.unscale_and_check = stub("lab 2", "PrecisionLab", "unscale_and_check")
ReferenceScaler = type("ReferenceScaler", (ScalerLab,), {"update": vars(LossScaler)["update"]})
ReferencePrecision = type("ReferencePrecision", (PrecisionLab,),
                          {"unscale_and_check": vars(MixedPrecision)["unscale_and_check"]})


# ------------------------------------------------------------------ one graded run, on every rank


def trajectory(scaler_class, settings, pattern) -> dict:
    """The scale after each step of `pattern`, and the step at which it gave up (or None)."""
    scaler = scaler_class(**settings)
    scales = []
    for step, mark in enumerate(pattern):
        try:
            scaler.update(mark == "x", step)
        except FloatingPointError:
            return {"scales": scales, "gave_up": step}
        scales.append(scaler.scale)
    return {"scales": scales, "gave_up": None}


def measure(plugin) -> dict:
    scaler = plugin["scaler"]
    out = {"rank": dist.get_rank(),
           "gradscaler": trajectory(scaler, dict(RULES, hysteresis=1), PATTERN),
           "hysteresis": trajectory(scaler, RULES, PATTERN),
           "give_up": {name: trajectory(scaler, s, p) for name, (s, p, _) in GIVE_UPS.items()}}
    out.update(_train_fp16(plugin))
    return out


def _train_fp16(plugin) -> dict:
    """ZeRO-1 in fp16 with the student's classes, STEPS steps; rank 1 plants an inf in out.bias's
    gradient at INF_STEP: out.bias sits in rank 0's slice of bucket 0, so only rank 0 sees it."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build()
    engine = ZeRO1(model, partial(torch.optim.SGD, lr=LR), precision="fp16", bucket_mb=0.0004)
    engine.precision = plugin["precision"]("fp16", scaler=plugin["scaler"](**SCALED), ledger=engine.comm)
    ratios = []
    engine.precision.unscale_and_check = _agreed(engine, engine.precision.unscale_and_check, ratios)
    plant = {"now": False}
    model.out.bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))
                                 if plant["now"] else g)
    applied, scales = [], []
    for step in range(STEPS):
        plant["now"] = rank == 1 and step == INF_STEP
        engine.backward(loss_of(engine, micro_batch(step, 0, rank, n), 1))
        applied.append(engine.step())
        scales.append(engine.precision.scale)
        engine.zero_grad()
    return {"applied": applied, "scales": scales, "ratios": ratios,
            "weights": {k: v.clone() for k, v in engine.full_state_dict().items()}, "ref": _reference(n)}


def _agreed(engine, unscale_and_check, ratios):
    """The grader's instrument around the student's unscale_and_check: note by how much it divided
    the gradients, and compare its verdict across ranks (one small all-reduce of its own)."""
    def checked(grads):
        before = [g.detach().clone() for g in grads if g is not None]
        scale = engine.precision.scale
        ok = unscale_and_check(grads)
        finite = [(b, g) for b, g in zip(before, (g for g in grads if g is not None))
                  if bool(torch.isfinite(b).all())]
        num = sum(float(b.abs().sum()) for b, _ in finite)
        den = sum(float(g.abs().sum()) for _, g in finite)
        ratios.append((num / den, scale) if den > 0 else None)     # (divided by, loss scale)
        verdicts = torch.tensor([float(bool(ok)), -float(bool(ok))])
        engine.comm.all_reduce(verdicts, op="max", tag="grader")
        if verdicts[0] != -verdicts[1]:
            raise Stop(AGREE, "verdicts_differ",
                       f"at step {engine.steps}, some ranks found their gradients finite and would step, "
                       "others found an inf and would skip (rank 1 planted an inf in a gradient only rank "
                       "0's slice holds): the ranks would diverge, and wait in different collectives.",
                       "after checking your own gradients, all-reduce the flag with op=\"max\" through "
                       "self.ledger, so that every rank returns the same verdict.")
        return ok
    return checked


def _reference(n) -> dict:
    """One process in fp32 on the global batch, SGD, the planted step skipped."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        if step == INF_STEP:
            continue
        loss_of(model, global_micro_batch(step, 0, n), 1).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ the checks, in the parent


def _count(k: int, what: str) -> str:
    return f"{k} {what}{'s' * (k != 1)}"


def _diagnose(pattern, expected, seen, k, hysteresis, growth_interval) -> tuple:
    """(key, what happened, what to do) at step k, the first where `seen` differs from `expected`."""
    before = expected[k - 1] if k else None
    was, got, should = (None if before is None else math.log2(before)), math.log2(seen[k]), math.log2(expected[k])
    overflow = pattern[k] == "x"
    recent = pattern[max(0, k - growth_interval + 1):k]
    if overflow and got > (was or got - 1):
        return "grew_on_overflow", "the scale grew at an overflow", "an overflow never grows the scale."
    if overflow and should == was and got < was:
        streak = len(pattern[:k + 1]) - len(pattern[:k + 1].rstrip("x"))   # overflows in a row up to k
        backoffs = [i for i in range(1, k) if expected[i] < expected[i - 1]]
        last = backoffs[-1] if backoffs else -1
        if last > k - streak:
            return ("backoff_not_refilled", f"it backed off again {_count(k - last, 'step')} after a back-off, within "
                    "the same run of overflows", "backing off refills the hysteresis count: the next back-off "
                    "needs `hysteresis` more overflows in a row.")
        if "x" in pattern[last + 1:k - streak + 1]:
            return ("hysteresis_not_refilled", "it backed off although a clean step came between the "
                    "overflows", "a clean step refills the hysteresis count: it counts overflows IN A ROW.")
        return ("no_hysteresis", f"it backed off after {_count(streak, 'overflow')} in a row; hysteresis={hysteresis} "
                f"tolerates {hysteresis - 1}", "back off only when the overflows in a row reach hysteresis.")
    if overflow and got == was and should < was:
        return "no_backoff", "it did not back off", "after `hysteresis` overflows in a row, multiply by backoff_factor."
    if not overflow and got > was and should == was:
        if "x" in recent:
            return ("grew_after_overflow", f"the scale grew although step {k - recent[::-1].index('x') - 1} "
                    "overflowed", "an overflow restarts the count of clean steps (_good_steps = 0).")
        since = max([i for i in range(k) if pattern[i] == "x" or (i and expected[i] > expected[i - 1])], default=-1)
        return ("grew_early", f"the scale grew after {k - since} clean steps in a row",
                f"grow after growth_interval = {growth_interval} clean steps in a row, not one sooner.")
    if not overflow and got == was and should > was:
        return ("no_growth", "the scale did not grow", f"after growth_interval = {growth_interval} clean steps in "
                "a row, grow, and start counting again from 0.")
    return "trajectory", "the scale went elsewhere", "follow the rules of chapter 2 step by step."


def _check_trajectory(d, expected, hysteresis, what):
    seen = d["scales"]
    if d["gave_up"] is not None:
        raise Wrong("gave_up_early", f"{what}: it raised FloatingPointError at step {d['gave_up']}, with the "
                    "scale far above min_scale and fewer than max_skips steps skipped in a row.",
                    "give up only at min_scale or after max_skips skipped steps in a row.")
    k = next((i for i, (a, b) in enumerate(zip(seen, expected)) if a != b), None)
    if k is None:
        return
    key, what_happened, hint = _diagnose(PATTERN, expected, seen, k, hysteresis, RULES["growth_interval"])
    shown = lambda xs: " ".join(f"{int(math.log2(x)):2d}" for x in xs[:k + 1])
    raise Wrong(key, f"{what}, pattern {PATTERN[:k + 1]} (x = overflow): at step {k} {what_happened}. "
                f"log2 of the scale after each step: expected {shown(expected)}; seen {shown(seen)}.", hint)


def gradscaler(ranks) -> str:
    expected = gradscaler_trajectory([c == "x" for c in PATTERN], RULES["init_scale"], RULES["growth_interval"])
    _check_trajectory(ranks[0]["gradscaler"], expected, 1, "with hysteresis=1, against torch's GradScaler")
    return f"over {len(PATTERN)} steps ({PATTERN}), the same scale as torch.amp.GradScaler after every step"


def hysteresis(ranks) -> str:
    _check_trajectory(ranks[0]["hysteresis"], [2.0**e for e in EXPECTED_LOG2], RULES["hysteresis"],
                      "with hysteresis=2, growth_interval=3")
    return "with hysteresis=2, the scale worked out by hand from the rules after every step"


def give_up(ranks) -> str:
    for name, (settings, pattern, step) in GIVE_UPS.items():
        got = ranks[0]["give_up"][name]
        if got["gave_up"] == step:
            continue
        raised = "did not raise" if got["gave_up"] is None else f"raised at step {got['gave_up']}"
        if name == "at min_scale":
            raise Wrong("no_give_up_at_floor", f"an overflow with the scale already at min_scale "
                        f"({settings['min_scale']:g}) must raise FloatingPointError (step {step} of "
                        f"{pattern}); it {raised}, and the scale went to {got['scales'][-1]:g}.",
                        "at min_scale there is no scale left to lower: the loss itself is inf or nan.")
        if name == "not for skips apart":
            raise Wrong("gave_up_on_total_skips", f"with max_skips = {settings['max_skips']}, pattern {pattern} "
                        f"(x = overflow) must never raise: no more than two steps in a row overflow. It raised "
                        f"FloatingPointError at step {got['gave_up']}, at skipped step number {settings['max_skips']} "
                        "in all, with a clean step between.",
                        "give up after max_skips skipped steps IN A ROW (self.skipped_in_a_row, which a clean step "
                        "sets back to 0), not after max_skips in all (self.skipped).")
        raise Wrong("no_give_up_after_max_skips", f"after max_skips = {settings['max_skips']} skipped steps in a "
                    f"row it must raise FloatingPointError (step {step} of {pattern}); it {raised}.",
                    "count skipped steps in a row (a clean step restarts the count).")
    return ("it raises FloatingPointError at an overflow at min_scale and after max_skips skips in a row, and not "
            "for as many skips with clean steps between")


def parity(ranks) -> str:
    want = [step != INF_STEP for step in range(STEPS)]
    for d in ranks:
        bad = [(s, r) for s, r in enumerate(d["ratios"]) if r is not None and abs(r[0] / r[1] - 1) > 1e-3]
        if bad:
            step, (divided, scale) = bad[0]
            if abs(divided * scale - 1) < 1e-3:
                raise Wrong("multiplied", f"at step {step} rank {d['rank']}'s gradients were multiplied by the "
                            f"scale, {scale:g}, instead of divided by it: they reached the optimizer {scale ** 2:g} "
                            "times too large.", "unscaling divides: multiply every gradient by 1 / scale.")
            how = (f"{scale / divided:.3g} times too large" if divided < scale else
                   f"{divided / scale:.3g} times too small")
            raise Wrong("not_unscaled", f"at step {step} rank {d['rank']}'s gradients were divided by "
                        f"{divided:.3g}, but the loss had been multiplied by the scale, {scale:g}: they reached "
                        f"the optimizer {how}.",
                        "multiply every gradient by 1 / scale, once, before the finite check.")
        if d["applied"] != want:
            if d["applied"][INF_STEP]:
                raise Wrong("stepped_on_overflow", f"rank {d['rank']} applied step {INF_STEP}, whose gradients "
                            f"held an inf on rank 0 (rank 1 planted it in out.bias, which only rank 0's slice "
                            "holds), and every rank agreed to apply it: the ranks' flags were combined so that a "
                            "finite rank outvoted the one that overflowed, and the update carried the inf into the "
                            "weights.",
                            "each rank's flag says \"I found an inf or nan\" (1) or not (0); combine them with "
                            "op=\"max\", so that one overflow anywhere makes every rank skip.")
            raise Wrong("applied", f"rank {d['rank']} applied the steps {d['applied']}; only step {INF_STEP} "
                        "overflowed.", "step() returns False exactly when the gradients overflowed.")
        err = max(float((d["weights"][k] - v).abs().max()) for k, v in d["ref"].items())
        if err > WEIGHT_TOL:
            raise Wrong("weights", f"after {STEPS} steps rank {d['rank']}'s fp32 master weights differ from one "
                        f"fp32 process's (the planted step skipped) by up to {err:.2g} (tolerance {WEIGHT_TOL:g}).",
                        "unscale the gradients once, and skip the whole step when any rank overflowed.")
    return (f"fp16 on 2 ranks: step {INF_STEP} skipped everywhere, the others applied, and the weights are one "
            f"fp32 process's within {WEIGHT_TOL:g}")


LAB = Lab(
    name="scaler", number=2, title="dynamic loss scaling", chapter="chapter 2, Mixed precision",
    stub_file="lab2_scaler.py", world_size=2,
    roles={"scaler": ScalerLab, "precision": PrecisionLab},
    reference={"scaler": ReferenceScaler, "precision": ReferencePrecision}, measure=measure,
    checks=(Check(AGREE, None, 'chapter 2, "The protocol" (the agreed overflow check)',
                  "every rank returned the same verdict at every step"),
            Check("hysteresis=1 follows torch's GradScaler", gradscaler,
                  'chapter 2, "Hysteresis: three rules under one name"'),
            Check("back-off, hysteresis and growth", hysteresis, 'chapter 2, "Hysteresis: three rules under one name"'),
            Check("it gives up when skipping cannot help", give_up, 'chapter 2, "3. Scale collapse"'),
            Check("parity with one fp32 process, the overflowed step skipped", parity, 'chapter 2, "The protocol"')),
    mistakes_module="zerolab.labs.scaler_mistakes",
    blame={**dict.fromkeys(("grew_on_overflow", "backoff_not_refilled", "hysteresis_not_refilled", "no_hysteresis",
                            "no_backoff", "grew_after_overflow", "grew_early", "no_growth", "trajectory",
                            "gave_up_early", "no_give_up_at_floor", "gave_up_on_total_skips",
                            "no_give_up_after_max_skips"), ("update",)),
           **dict.fromkeys(("verdicts_differ", "multiplied", "not_unscaled", "stepped_on_overflow", "applied",
                            "weights"), ("unscale_and_check",))},
)
