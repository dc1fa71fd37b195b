"""Three dynamic loss scalers driven by the same pattern of overflows (chapter 2).

    trajectories(pattern, hysteresis=2)  ->  {"torch GradScaler": [...], "DeepSpeed default": [...],
                                             "zerolab LossScaler": [...]}

`pattern` lists, step by step, whether that step's gradients overflowed. Each scaler sees the
same pattern and the scale it holds after every step is recorded. Nothing is trained: the point
is the rule each one follows.

* torch.amp.GradScaler is the real one, run on CPU: it halves on every overflow, has no
  hysteresis and no minimum.
* DeepSpeed is not a dependency of this book, so its rule is transcribed below, line for line,
  from DynamicLossScaler.update_scale in deepspeed/runtime/fp16/loss_scaler.py (commit
  38327e07f6cd, February 2025), with the defaults of a DeepSpeed fp16 config: loss_scale_window
  1000, hysteresis 2, consecutive_hysteresis false, min_loss_scale 1.
* zerolab.precision.LossScaler is the real one.
"""

from __future__ import annotations

import torch

from ..precision import LossScaler


class DeepSpeedDynamicLossScaler:
    """The scale rule of DeepSpeed's DynamicLossScaler (transcribed; logging left out).

    On an overflow: if the hysteresis left is 1, the scale is divided by scale_factor (an
    overflow at min_scale raises instead); otherwise the hysteresis left drops by one. The
    hysteresis is refilled only when the scale grows, after scale_window steps without an
    overflow, unless consecutive_hysteresis is set, in which case every clean step refills it.
    Note that backing off does not refill it: once spent, every later overflow halves the scale
    until the next growth.
    """

    def __init__(self, init_scale=2.0**16, scale_factor=2.0, scale_window=1000, min_scale=1,
                 delayed_shift=2, consecutive_hysteresis=False, raise_error_at_min_scale=True):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise Exception("Current loss scale already at minimum - cannot decrease scale "
                                    "anymore. Exiting run.")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def gradscaler_trajectory(pattern, init_scale=2.0**16, growth_interval=1000) -> list:
    """The scale after each step of torch.amp.GradScaler (CPU) fed `pattern`'s overflows."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    out = []
    for overflow in pattern:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if overflow:
            p.grad.fill_(float("inf"))
        scaler.step(opt)        # skipped when the gradient holds an inf
        scaler.update()
        out.append(scaler.get_scale())
    return out


def deepspeed_trajectory(pattern, init_scale=2.0**16, hysteresis=2, scale_window=1000,
                         consecutive_hysteresis=False) -> list:
    s = DeepSpeedDynamicLossScaler(init_scale, scale_window=scale_window, delayed_shift=hysteresis,
                                   consecutive_hysteresis=consecutive_hysteresis)
    out = []
    for overflow in pattern:
        s.update_scale(bool(overflow))
        out.append(s.cur_scale)
    return out


def zerolab_trajectory(pattern, init_scale=2.0**16, hysteresis=2, growth_interval=1000) -> list:
    s = LossScaler(init_scale=init_scale, hysteresis=hysteresis, growth_interval=growth_interval)
    out = []
    for step, overflow in enumerate(pattern):
        s.update(bool(overflow), step)
        out.append(s.scale)
    return out


def trajectories(pattern, hysteresis: int = 2, init_scale: float = 2.0**16) -> dict:
    """The scale after each step for the three scalers (growth after 1000 clean steps in all)."""
    return {"torch GradScaler": gradscaler_trajectory(pattern, init_scale),
            "DeepSpeed default": deepspeed_trajectory(pattern, init_scale, hysteresis),
            "DeepSpeed consecutive": deepspeed_trajectory(pattern, init_scale, hysteresis,
                                                          consecutive_hysteresis=True),
            "zerolab LossScaler": zerolab_trajectory(pattern, init_scale, hysteresis)}
