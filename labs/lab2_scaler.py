"""Lab 2: dynamic loss scaling with skip, back-off and growth, agreed over ranks (chapter 2).

Write the two methods below. The grader feeds your scaler patterns of overflows and compares the
scale after every step with torch's GradScaler and with the rules worked out by hand; then it
trains in fp16 on 2 ranks with zl.ZeRO(stage=1), your scaler and your check plugged in, while
rank 1 plants an inf in a gradient that only rank 0's slice holds. Stuck? The lab's notebook
has hints, folded: open one at a time.

    python -m zerolab.labs grade scaler labs/lab2_scaler.py
"""

import torch

from zerolab.labs.scaler import PrecisionLab, ScalerLab


class MyLossScaler(ScalerLab):
    def update(self, found_inf, step=None):
        """Advance the scale after one step; found_inf says whether that step's gradients held an
        inf or a nan (the step was then skipped). `step` is only for messages.

        Overflow:  count it as skipped (self.skipped, self.skipped_in_a_row). Give up, raising
                   FloatingPointError, if the scale is already at (or below) self.min_scale, or once
                   self.skipped_in_a_row reaches self.max_skips: then the loss itself is inf or nan
                   and skipping would train nothing while looking alive. Otherwise an overflow
                   restarts the count of clean steps, and uses up one of the overflows that
                   hysteresis tolerates (self._overflows_left); when none is left, multiply the
                   scale by self.backoff_factor (never below self.min_scale) and refill the count
                   to self.hysteresis.
        Clean:     restart self.skipped_in_a_row; refill self._overflows_left (hysteresis counts
                   overflows IN A ROW); count the clean step, and after self.growth_interval clean
                   steps in a row multiply the scale by self.growth_factor and start counting again.

        With hysteresis=1 this is torch.amp.GradScaler's rule exactly."""
        raise NotImplementedError("update")


class MyPrecision(PrecisionLab):
    def unscale_and_check(self, grads):
        """grads: the fp32 gradients this rank updates (its slices under ZeRO), computed from the loss
        multiplied by self.scaler.scale.

        Must: leave each gradient divided by the scale, in place, and return True if EVERY rank's
        gradients are finite, False if any rank's hold an inf or a nan: the same answer on every
        rank, so that they all step, or all skip, together, although each rank sees only its own.

        May use: self.scaler.scale, torch.isfinite, self.ledger (a zerolab.runtime.comm.Ledger:
        all_reduce(tensor, op="sum" | "max" | ..., group=self.group))."""
        raise NotImplementedError("unscale_and_check")
