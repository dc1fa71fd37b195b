"""The runs chapter 2 shows: one GPT trained four ways, and each failure mode reproduced.

    four_ways(steps=120)    fp32 | naive fp16 (no master copy) | fp16 + master + loss scaling | bf16 + master
    small_lr_runs(lr, steps)  fp32 | naive fp16 | fp16 + master at a learning rate where fp16 loses updates

Every run starts from the same initial weights and sees the same batches, so the curves differ
only by arithmetic. The engine is zerolab.engines.single.SingleProcess except for the naive run, which is
written out here because no engine should ever do it.
"""

from __future__ import annotations

import functools
import time

import torch

from .. import data, models
from ..precision import LossScaler, MixedPrecision
from ..engines.single import SingleProcess

CONFIG = dict(size="nano", batch_size=8, lr=1e-3, seed=0)


def make_model(seed: int = 0, size: str = "nano") -> torch.nn.Module:
    torch.manual_seed(seed)
    return models.GPT(models.gpt_config(size))


class NaiveFP16:
    """fp16 weights updated in place: the optimizer's arithmetic is fp32, but its result is
    rounded straight back into fp16 weights and nothing remembers what the rounding lost.
    No loss scaling either. This is the "no master copy" mistake, kept for the demonstration.
    """

    def __init__(self, model, optimizer):
        self.model = model.half()
        self.params = [p for p in model.parameters() if p.requires_grad]
        # scratch fp32 tensors for the optimizer's arithmetic; they are overwritten from the
        # fp16 weights before every step, so they are NOT a master copy
        self.work = [p.detach().float() for p in self.params]
        self.optimizer = optimizer(self.work)
        self.lost = 0.0  # fraction of elements whose nonzero update vanished in the last step

    def __call__(self, *inputs):
        return self.model(*inputs)

    def backward(self, loss):
        loss.backward()

    @torch.no_grad()
    def step(self) -> bool:
        moved = wanted = 0
        for p, w in zip(self.params, self.work):
            w.copy_(p)                           # forget everything below fp16's spacing
            w.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        for p, w in zip(self.params, self.work):
            new = w.to(torch.float16)
            wanted += int((w != p.float()).sum())
            moved += int((new != p).sum())
            p.copy_(new)
        self.lost = 1 - moved / max(wanted, 1)
        return True

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)


def make_engine(kind: str, model, lr: float, scaler: LossScaler | None = None):
    """kind: "fp32", "naive fp16", "fp16" or "bf16"."""
    opt = functools.partial(torch.optim.AdamW, lr=lr)
    if kind == "naive fp16":
        return NaiveFP16(model, opt)
    return SingleProcess(model, opt, precision=kind, scaler=scaler, track_peak=False)


def train(kind: str, steps: int, *, size="nano", batch_size=8, lr=1e-3, seed=0,
          scaler: LossScaler | None = None, track_moved: bool = False) -> dict:
    """Train one way; returns the loss curve, step times, and (fp16) the scale trajectory.

    track_moved: also record, after every step, the fraction of the weights the forward pass
    uses (the model's own parameters, 16-bit in every run but fp32) that differ from their
    initial values: a weight whose updates are all rounded away never moves."""
    engine = make_engine(kind, make_model(seed, size), lr, scaler)
    ds = data.CharDataset(engine.model.cfg.block_size, seed=seed)
    out = {"kind": kind, "loss": [], "seconds": [], "scale": [], "applied": [], "lost": [], "moved": []}
    start = [p.detach().clone() for p in engine.model.parameters()] if track_moved else None
    n_weights = sum(p.numel() for p in engine.model.parameters())
    for step in range(steps):
        t0 = time.perf_counter()
        _, loss = models.gpt_loss(engine, ds.batch(step, batch_size))
        engine.backward(loss)
        applied = engine.step()
        engine.zero_grad()
        out["seconds"].append(time.perf_counter() - t0)
        out["loss"].append(loss.item())
        out["applied"].append(applied)
        if isinstance(engine, SingleProcess) and engine.precision.scaler is not None:
            out["scale"].append(engine.precision.scale)
        if isinstance(engine, NaiveFP16):
            out["lost"].append(engine.lost)
        if track_moved:
            with torch.no_grad():
                moved = sum(int((p != p0).sum()) for p, p0 in zip(engine.model.parameters(), start))
            out["moved"].append(moved / n_weights)
    return out


def four_ways(steps: int = 120, *, growth_interval: int = 20, **kw) -> dict:
    """The four runs of chapter 2, one after another in this process (so their step times
    are measured on the same machine in the same run)."""
    runs = {}
    for kind in ("fp32", "naive fp16", "fp16", "bf16"):
        scaler = LossScaler(growth_interval=growth_interval) if kind == "fp16" else None
        runs[kind] = train(kind, steps, scaler=scaler, **kw)
    return runs


def small_lr_runs(lr: float = 3e-6, steps: int = 300, **kw) -> dict:
    """fp32, naive fp16 and fp16 with master weights at a learning rate small enough that most
    of naive fp16's updates fall below half the spacing of the weight they update (bf16 would
    lose even more: its spacing is 8 times fp16's). Tracks the weights that moved."""
    runs = {}
    for kind in ("fp32", "naive fp16", "fp16"):
        scaler = LossScaler(growth_interval=100) if kind == "fp16" else None
        runs[kind] = train(kind, steps, lr=lr, scaler=scaler, track_moved=True, **kw)
    return runs


def update_threshold_lr(size: str = "nano", seed: int = 0) -> dict:
    """The median |weight| of a fresh model and the learning rate at which an Adam-sized update
    (about lr) of that weight is half its fp16 spacing: below it, the median weight stops moving
    in pure fp16. ulp(w) = 2^(floor(log2 |w|) - 10), so the threshold is ulp(median) / 2."""
    from .. import numerics
    w = torch.cat([p.detach().abs().flatten() for p in make_model(seed, size).parameters()])
    median = w.median().item()
    return {"median |w|": median, "threshold lr": numerics.ulp(median, "fp16") / 2}


def smooth(xs, k: int = 10):
    """Trailing mean over k steps, for plotting noisy loss curves."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


# ------------------------------------------------------------------ failure modes, one each


def overflow_demo() -> dict:
    """fp16 overflow: a forward value past 65504 becomes inf, and so does everything after it."""
    x = torch.tensor([200.0, 300.0], dtype=torch.float16)
    squared = x * x                     # 40000 fits, 90000 does not
    logits = torch.tensor([10.0, 12.0], dtype=torch.float16)
    naive_softmax = torch.exp(logits) / torch.exp(logits).sum()   # exp(12) = 162755 > 65504
    return {"x": x.tolist(), "x*x": squared.tolist(), "exp(logits)": torch.exp(logits).tolist(),
            "naive softmax": naive_softmax.tolist(),
            "stable softmax": torch.softmax(logits.float(), 0).to(torch.float16).tolist()}


def scaled_gradient_overflow(steps: int = 12, init_scale: float = 2.0**30) -> dict:
    """A loss scale that is far too large: every scaled gradient overflows and the step is
    skipped until the scaler has backed off into range. The engine is the real one."""
    scaler = LossScaler(init_scale=init_scale, growth_interval=1000)
    return train("fp16", steps, scaler=scaler, lr=CONFIG["lr"])


def stalled_update_paths(lr: float = 1e-4, steps: int = 200) -> dict:
    """One weight at 1.0 pushed by Adam-sized updates (about lr each), step by step: kept in fp16
    it never moves; kept as an fp32 master it moves by lr * steps, and the master's fp16 copy
    (what the next forward pass uses) follows it one fp16 spacing at a time."""
    fp16 = torch.tensor(1.0, dtype=torch.float16)
    master = torch.tensor(1.0, dtype=torch.float32)
    paths = {"fp16 weight": [], "fp32 master": [], "fp16 of master": []}
    for _ in range(steps):
        fp16 = (fp16.float() - lr).to(torch.float16)  # update computed in fp32, stored in fp16
        master = master - lr
        paths["fp16 weight"].append(fp16.item())
        paths["fp32 master"].append(master.item())
        paths["fp16 of master"].append(master.to(torch.float16).item())
    return paths


def stalled_update_demo(lr: float = 1e-4, steps: int = 200) -> dict:
    """stalled_update_paths' values after the last step."""
    return {key: path[-1] for key, path in stalled_update_paths(lr, steps).items()}


def scale_collapse_demo(steps: int = 40, min_scale: float = 1.0, hysteresis: int = 1) -> dict:
    """A NaN in every gradient (a bug, not an overflow): the scaler blames the scale and backs off
    every step until the scale reaches min_scale; the next overflow there ends the run
    (FloatingPointError, whose first sentence is returned as "stopped")."""
    mp = MixedPrecision("fp16", scaler=LossScaler(init_scale=2.0**16, hysteresis=hysteresis,
                                                  min_scale=min_scale))
    scales, applied, stopped = [], [], None
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        grad = torch.randn(64, generator=g) * mp.scale
        grad[7] = float("nan")
        ok = mp.unscale_and_check([grad])
        try:
            mp.update(found_inf=not ok, step=step)
        except FloatingPointError as e:
            stopped = str(e).split(". ")[0]
            break
        scales.append(mp.scale)
        applied.append(ok)
    return {"scale": scales, "applied": applied, "stopped": stopped}


def memory_per_param(precision: str = "fp16", size: str = "nano") -> dict:
    """Measured bytes per parameter around a real AdamW step (zerolab.memory counts storages).

    The step measured is the second one: the first also creates Adam's moments, which then
    live for the rest of training. "held at step start" is what the model states occupy when
    step() begins, "step increment" the most bytes step() allocates above that at any moment
    (the short-lived fp32 gradients and the optimizer's temporaries), and "peak during step"
    their sum: the most the step holds."""
    model = make_model(0, size)
    n = models.num_params(model)
    engine = SingleProcess(model, functools.partial(torch.optim.AdamW, lr=1e-3), precision=precision,
                           track_peak=True)     # step() measures its own peak
    ds = data.CharDataset(model.cfg.block_size)
    for step in range(2):
        _, loss = models.gpt_loss(engine, ds.batch(step, 8))
        engine.backward(loss)
        held = engine.memory_report()["total"]    # after backward: the 16-bit gradients exist
        engine.step()
        report = engine.memory_report()  # measured before zero_grad: the gradients still exist
        if step == 0:
            engine.zero_grad()
    masters = sum(m.numel() * m.element_size() for m in engine.masters) if precision != "fp32" else 0
    out = {"params": report["params"] / n, "grads": report["grads"] / n,
           "master": masters / n, "moments+counters": (report["optimizer"] - masters) / n,
           "total": report["total"] / n, "held at step start": held / n,
           "step increment": report["peak"] / n, "peak during step": (held + report["peak"]) / n,
           "n_params": n}
    return out


def gradient_magnitudes(size: str = "nano", seed: int = 0, batch_size: int = 8) -> torch.Tensor:
    """|gradient| of every element of a freshly initialised GPT after one fp32 backward."""
    model = make_model(seed, size)
    ds = data.CharDataset(model.cfg.block_size, seed=seed)
    _, loss = models.gpt_loss(model, ds.batch(0, batch_size))
    loss.backward()
    return torch.cat([p.grad.detach().abs().flatten() for p in model.parameters()])


def lost_updates(lrs=(1e-3, 3e-4, 1e-4, 3e-5, 1e-5), steps: int = 15) -> list:
    """Fraction of nonzero updates the naive fp16 run loses, averaged over `steps`, per lr."""
    out = []
    for lr in lrs:
        r = train("naive fp16", steps, lr=lr)
        out.append(sum(r["lost"]) / len(r["lost"]))
    return out


def step_time_ratios(runs: dict, skip: int = 5) -> dict:
    """Median step time of each run divided by fp32's (the first `skip` steps are warm-up)."""
    base = step_time_spread(runs["fp32"], skip)["median"]
    return {kind: step_time_spread(r, skip)["median"] / base for kind, r in runs.items()}


def step_time_spread(run: dict, skip: int = 5) -> dict:
    """Median and quartiles of one run's step times in seconds, after `skip` warm-up steps."""
    xs = sorted(run["seconds"][skip:])
    def at(q):
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]
    return {"q1": at(0.25), "median": at(0.5), "q3": at(0.75), "n": len(xs)}
