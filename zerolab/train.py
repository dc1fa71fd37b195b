"""Train the book's GPT from the shell: `python -m zerolab train --world-size 2 --steps 100`.

Each rank builds the same model (same seed), wraps it in the chosen engine, and trains on its
share of every step's global batch. The parent shows a progress bar fed by rank 0, then prints
a report: final loss, tokens per second, measured memory per rank, bytes each rank sent, and
writes the loss curve as a PNG.

Strategies:
    single   every rank runs the single-process reference on the whole global batch
             (no communication; what every other engine must reproduce)
    ddp      zl.DDP, each rank on its share of the batch
    zero1..3 zl.ZeRO(stage=1..3), when the installed zerolab has it
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass

import torch

from . import data, memory, models
from .launch import launch, rank, world_size


def available_strategies() -> list:
    """The strategies this installation of zerolab can run."""
    names = []
    if importlib.util.find_spec("zerolab.single"):
        names.append("single")
    if importlib.util.find_spec("zerolab.ddp"):
        names.append("ddp")
    if importlib.util.find_spec("zerolab.zero"):
        names += ["zero1", "zero2", "zero3"]
    return names


PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class TrainConfig:
    size: str = "tiny"
    strategy: str = "single"
    precision: str = "fp32"
    world_size: int = 2
    steps: int = 100
    batch_size: int = 8          # per rank
    lr: float = 3e-3
    seed: int = 0
    bucket_mb: float = 25.0

    def check(self) -> "TrainConfig":
        models.gpt_config(self.size)  # raises on an unknown size
        if self.strategy not in available_strategies():
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {available_strategies()}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {list(PRECISIONS)}")
        for name in ("world_size", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        return self


def make_engine(cfg: TrainConfig, model: torch.nn.Module):
    """Wrap `model` in the engine named by cfg.strategy."""
    optimizer = functools.partial(torch.optim.AdamW, lr=cfg.lr, weight_decay=0.0)
    if cfg.strategy == "single":
        from .single import SingleProcess
        return SingleProcess(model, optimizer, precision=cfg.precision)
    if cfg.strategy == "ddp":
        from .ddp import DDP
        return DDP(model, optimizer, precision=cfg.precision, bucket_mb=cfg.bucket_mb)
    from .zero import ZeRO
    return ZeRO(model, optimizer, stage=int(cfg.strategy[-1]), precision=cfg.precision,
                bucket_mb=cfg.bucket_mb)


def train_worker(cfg: TrainConfig, progress=None) -> dict:
    """One rank's training run. Returns its losses, speed, measured memory and bytes sent."""
    torch.manual_seed(cfg.seed)
    model_cfg = models.gpt_config(cfg.size)
    model = models.GPT(model_cfg).to(_device())
    engine = make_engine(cfg, model)
    dataset = data.CharDataset(model_cfg.block_size, seed=cfg.seed)
    r, n = rank(), world_size()
    losses, skipped = [], 0
    show_bar = progress is None and r == 0 and sys.stderr.isatty()
    bar = _bar(cfg.steps) if show_bar else None
    start = time.perf_counter()
    for step in range(cfg.steps):
        if cfg.strategy == "single":  # the reference sees the whole global batch
            batch = dataset.batch(step, cfg.batch_size * n)
        else:
            batch = dataset.batch(step, cfg.batch_size, r, n)
        batch = tuple(t.to(_device()) for t in batch)
        last = step == cfg.steps - 1
        with memory.PeakMemory(_device()) if last else _nothing() as peak:  # measure the last step
            _, loss = models.gpt_loss(engine, batch)
            engine.backward(loss)
            skipped += not engine.step()
        if last:
            report = engine.memory_report()  # before zero_grad, while gradients are held
            report["peak"] = peak.peak
        engine.zero_grad()
        losses.append(loss.item())
        if progress is not None and r == 0:
            progress.put((step + 1, losses[-1]))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    tokens = cfg.steps * cfg.batch_size * n * model_cfg.block_size
    return {"rank": r, "losses": losses, "skipped": skipped, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed, "memory": report,
            "bytes_sent": engine.comm.bytes(), "params": models.num_params(model)}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _device():
    from .launch import device
    return device()


def _bar(total):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="training", unit="step")


def _follow_progress(queue, total, stop):
    """Parent side: draw the progress bar from rank 0's messages."""
    bar = _bar(total)
    done = 0
    while done < total and not stop.is_set():
        try:
            step, loss = queue.get(timeout=0.2)
        except Exception:  # queue.Empty, or the queue closed under us
            continue
        bar.update(step - done)
        bar.set_postfix(loss=f"{loss:.3f}")
        done = step
    bar.close()


def run(cfg: TrainConfig, show_progress: bool = True) -> list:
    """Train with `cfg` on cfg.world_size ranks; returns each rank's result dict."""
    cfg.check()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: we are one of the ranks
        return launch(train_worker, cfg.world_size, args=(cfg, None))
    if not show_progress:
        return launch(train_worker, cfg.world_size, args=(cfg, None))
    from .launch import _context
    queue = _context().Queue()
    stop = threading.Event()
    follower = threading.Thread(target=_follow_progress, args=(queue, cfg.steps, stop), daemon=True)
    follower.start()
    try:
        return launch(train_worker, cfg.world_size, args=(cfg, queue))
    finally:
        stop.set()
        follower.join(2.0)


def format_report(cfg: TrainConfig, results: list) -> str:
    """The final report: one block for the run, one line per rank."""
    r0 = results[0]
    lines = [
        f"zerolab train: GPT-{cfg.size} ({r0['params']:,} parameters), strategy={cfg.strategy}, "
        f"precision={cfg.precision}, world size {cfg.world_size}, {cfg.steps} steps",
        f"  loss: first {r0['losses'][0]:.4f}, last {r0['losses'][-1]:.4f}"
        + (f", {r0['skipped']} step(s) skipped on overflow" if r0['skipped'] else ""),
        f"  speed: {sum(r['tokens_per_s'] for r in results) / len(results):,.0f} tokens/s "
        f"(whole job), {r0['seconds'] / cfg.steps * 1e3:.1f} ms per step",
        "  measured per rank (peak: allocated during the last step, above what it started with):",
        "  rank   params        grads         optimizer     total         peak/step     bytes sent",
    ]
    for r in results:
        m = r["memory"]
        lines.append(f"  {r['rank']:>4}   {_mb(m['params'])}  {_mb(m['grads'])}  {_mb(m['optimizer'])}  "
                     f"{_mb(m['total'])}  {_mb(m.get('peak', 0))}  {_mb(r['bytes_sent'])}")
    return "\n".join(lines)


def _mb(nbytes) -> str:
    return f"{nbytes / 2**20:8.3f} MiB"


def plot_losses(results: list, path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        ax.plot(r["losses"], label=f"rank {r['rank']}", alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title or "training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="tiny", choices=sorted(models.SIZES), help="GPT size")
    parser.add_argument("--strategy", default="single", choices=available_strategies(),
                        help="how the ranks share the work")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--world-size", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--plot", default="zerolab-loss.png", help="where to write the loss curve PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    cfg = TrainConfig(size=args.size, strategy=args.strategy, precision=args.precision,
                      world_size=int(os.environ.get("WORLD_SIZE", args.world_size)),
                      steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      bucket_mb=args.bucket_mb)
    try:
        cfg.check()
    except ValueError as exc:
        print(f"zerolab train: error: {exc}", file=sys.stderr)
        return 2
    results = run(cfg, show_progress=not args.no_progress)
    if rank() == 0:
        print(format_report(cfg, results))
        if args.plot:
            plot_losses(results, args.plot, f"GPT-{cfg.size}, {cfg.strategy}, {cfg.precision}")
            print(f"  loss curve: {args.plot}")
        print("  config:", asdict(cfg))
    return 0
