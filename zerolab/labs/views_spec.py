"""Lab 7's run and the words its checks share (zerolab.labs.views grades, zerolab.labs.views_checks
checks during the run, zerolab.labs.views_parity in the parent): the seams, the checks' titles, the
steps the grader trains and where it looks, and two small helpers for messages.
"""

from __future__ import annotations

from ..engines import seams

SEAMS = seams.of("ParamViews")
VIEWS = "the views: one per parameter, this rank's part of it, in the script's groups"
GRADS = "gradients: each view's .grad is its range of the flat gradient, None where skipped"
SECTION = 'chapter 6, "What the optimizer is handed, and what its state dict holds"'

BUCKET_MB = 0.0008              # three buckets of LabNetWithBranch: whole, cut and empty views on both ranks
BRANCH = (False, True, False, True)     # does step s's forward take the side block?
CHECKPOINT_AFTER = 1            # a plain run's checkpoint after this step is loaded and continued
STATE_DICTS_AT = (0, 3)         # optimizer.state_dict() is compared after these steps
LR, EPS, DECAY = 1e-3, 1e-6, 0.1


def span(lo, hi) -> str:
    """'[lo, hi)': a range, ends excluded as in Python's slices."""
    return f"[{lo}, {hi})"


def dtype_name(t) -> str:
    """'float32' for a float32 tensor."""
    return str(t.dtype).replace("torch.", "")
