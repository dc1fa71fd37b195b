"""Lab 2's planted mistakes: zerolab.precision's LossScaler.update and
MixedPrecision.unscale_and_check with one thing wrong, as students write them. Each must fail the
grader with the failure named in `expect`."""

from __future__ import annotations

import torch

from ..precision import found_overflow
from .lab import Mistake
from .scaler import ReferencePrecision, ReferenceScaler


class _Rules(ReferenceScaler):
    """LossScaler.update written out, with switches for the planted mistakes."""

    reset_good_on_overflow = refill_on_clean = refill_on_backoff = floor = reset_good_on_growth = True
    hysteresis_on = count_skips = skips_in_a_row = backoff_assigned = True
    grow_after = 0                  # clean steps short of growth_interval at which it grows

    def update(self, found_inf, step=None):
        if found_inf:
            at_floor = self.scale <= self.min_scale
            self.skipped += 1
            self.skipped_in_a_row += 1
            skips = self.skipped_in_a_row if self.skips_in_a_row else self.skipped
            if (self.floor and at_floor) or (self.count_skips and skips >= self.max_skips):
                raise FloatingPointError(f"fp16 gives up at step {step}")
            if self.reset_good_on_overflow:
                self._good_steps = 0
            self._overflows_left = self._overflows_left - 1 if self.hysteresis_on else 0
            if self._overflows_left <= 0:
                lower = max(self.scale * self.backoff_factor, self.min_scale) if self.floor else \
                    self.scale * self.backoff_factor
                if self.backoff_assigned:
                    self.scale = lower
                if self.refill_on_backoff:
                    self._overflows_left = self.hysteresis
        else:
            self.skipped_in_a_row = 0
            if self.refill_on_clean:
                self._overflows_left = self.hysteresis
            self._good_steps += 1
            if self._good_steps == self.growth_interval - self.grow_after:
                self.scale *= self.growth_factor
                if self.reset_good_on_growth:
                    self._good_steps = 0


def _rules(name, **wrong):
    return type(name, (_Rules,), wrong)


class LocalVerdict(ReferencePrecision):
    def unscale_and_check(self, grads):
        grads = [g for g in grads if g is not None]
        for g in grads:
            g.mul_(1.0 / self.scaler.scale)
        return not found_overflow(grads)        # (this rank's verdict only: no ledger)


class AgreesOnFinite(ReferencePrecision):
    def unscale_and_check(self, grads):
        grads = [g for g in grads if g is not None]
        for g in grads:
            g.mul_(1.0 / self.scaler.scale)
        finite = torch.tensor([0.0 if found_overflow(grads) else 1.0])
        self.ledger.all_reduce(finite, op="max", group=self.group, tag="overflow")   # (any finite rank wins)
        return bool(finite.item() > 0)


class MultipliesByScale(ReferencePrecision):
    def unscale_and_check(self, grads):
        grads = [g for g in grads if g is not None]
        for g in grads:
            g.mul_(self.scaler.scale)       # (times the scale, where 1 / scale undoes it)
        return not found_overflow(grads, self.ledger, self.group)


class NotUnscaled(ReferencePrecision):
    def unscale_and_check(self, grads):
        grads = [g for g in grads if g is not None]    # (checked, but never divided by the scale)
        return not found_overflow(grads, self.ledger, self.group)


def _s(name, story, expect, **wrong):
    return Mistake(name, story, {"scaler": _rules(name, **wrong)}, expect)


MISTAKES = (
    _s("grows_after_overflow", "kept counting clean steps across an overflow", "grew_after_overflow",
       reset_good_on_overflow=False),
    _s("no_hysteresis", "backed off at every overflow", "no_hysteresis", hysteresis_on=False),
    _s("clean_step_does_not_refill", "refilled the hysteresis count only when backing off",
       "hysteresis_not_refilled", refill_on_clean=False),
    _s("backoff_does_not_refill", "did not refill the hysteresis count when backing off", "backoff_not_refilled",
       refill_on_backoff=False),
    _s("no_floor", "let the scale fall below min_scale instead of giving up", "no_give_up_at_floor", floor=False),
    _s("growth_does_not_restart", "did not restart the clean-step count after growing", "no_growth",
       reset_good_on_growth=False),
    _s("skips_forever", "never gave up after max_skips skipped steps", "no_give_up_after_max_skips",
       count_skips=False),
    _s("grows_one_step_early", "grew after growth_interval - 1 clean steps", "grew_early", grow_after=1),
    _s("backoff_not_assigned", "computed the backed-off scale but never stored it", "no_backoff",
       backoff_assigned=False),
    _s("counts_all_skips", "gave up after max_skips skipped steps in all, not in a row", "gave_up_on_total_skips",
       skips_in_a_row=False),
    Mistake("local_verdict", "checked this rank's gradients only", {"precision": LocalVerdict}, "verdicts_differ"),
    Mistake("agrees_on_finite", "all-reduced the \"all finite\" flag with max: one finite rank outvotes an overflow",
            {"precision": AgreesOnFinite}, "stepped_on_overflow"),
    Mistake("multiplies_by_scale", "multiplied the gradients by the scale instead of dividing",
            {"precision": MultipliesByScale}, "multiplied"),
    Mistake("not_unscaled", "checked the gradients without dividing them by the scale", {"precision": NotUnscaled},
            "not_unscaled"),
)
