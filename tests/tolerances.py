"""How far two correct fp32 AdamW trainings may drift apart, and why.

zerolab's engines, PyTorch's own and one process on the global batch add the same numbers in
different orders, and so does the same code on another CPU: AVX2, AVX-512 and Arm kernels (and
MKL's and oneDNN's own dispatch) split a sum differently. Every order rounds differently, so a
gradient element carries a round-off error dg of a few ulp of the terms it adds up.

AdamW's first update of an element is lr * g / (|g| + eps); its derivative is
lr * eps / (|g| + eps)^2, so a round-off dg changes the update by about

    lr * eps * dg / (|g| + eps)^2

(later steps divide by the accumulated moments and damp it). For most elements that is far
below one ulp of the weight; for an element whose gradient is nearly zero (|g| of order eps)
it is up to lr * dg / eps: Adam turns pure round-off into a visible step. test_tolerances
measures the largest such per-step change on the tests' own models and batches (an fp32
gradient against an fp64 one) and checks it stays below ADAM_ROUNDOFF_STEP. Two fp32 orders are
each within that of the exact update, so they differ by at most twice it per step, and the
differences of successive steps add up: fp32_adamw_tol(steps).

The attention key bias is the extreme case: softmax ignores a shift, so its gradient is exactly
zero in real arithmetic and pure round-off in floating point. With eps=1e-6 the bound covers it;
with PyTorch's default eps=1e-8 the same noise would make steps a hundred times larger, which is
why the parity tests pass eps=1e-6.

A real bug is far above these tolerances: an element whose gradient is wrong, or a bucket that
missed its reduction, moves by about lr (1e-3) per step, about fifty times fp32_adamw_tol(3).
"""

LR = 1e-3    # the parity tests' AdamW: lr=1e-3, eps=1e-6
EPS = 1e-6
# measured at most 2.6e-6 per step with ATen's default (unvectorised) kernels, 1.5e-6 with AVX2 and
# 1.0e-6 with AVX-512 (GPT nano, bias=False, batches of 2 to 8 rows, x86-64, torch 2.13). On a CPU
# whose kernels round worse, test_tolerances fails first and names this premise.
ADAM_ROUNDOFF_STEP = 3e-6


def fp32_adamw_tol(steps: int) -> float:
    """Max-abs tolerance on fp32 weights after `steps` AdamW steps (lr=1e-3, eps=1e-6) taken with
    two different summation orders (N ranks against one process, zerolab against PyTorch)."""
    return 2 * steps * ADAM_ROUNDOFF_STEP


def adam_roundoff_step(g32, g64, lr=LR, eps=EPS) -> float:
    """The largest change round-off makes to one AdamW update: lr * eps * |g32 - g64| / (|g| + eps)^2
    over every element of the gradients (dicts name -> tensor; g64 the fp64 reference)."""
    worst = 0.0
    for name, exact in g64.items():
        dg = (g32[name].double() - exact).abs()
        worst = max(worst, (lr * eps * dg / (exact.abs() + eps) ** 2).max().item())
    return worst
