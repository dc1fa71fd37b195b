"""Train the book's GPT from the shell: `python -m zerolab train --world-size 2 --steps 100`.

Each rank builds the same model (same seed), wraps it in the chosen engine, and trains on its
share of every step's global batch. The parent shows a progress bar fed by rank 0, then prints
a report: final loss, tokens per second, measured memory per rank, bytes each rank sent, and
writes the loss curve as a PNG.

Strategies (--strategy; the default is ddp with more than one rank, single with one):
    single   every rank runs the single-process reference on the whole global batch
             (no communication; what every other engine must reproduce)
    ddp      zl.DDP, each rank on its share of the batch
    zero1..3 zl.ZeRO(stage=1..3), when the installed zerolab has it

Nothing lost (zerolab.checkpoint): `--save-every N --save-dir D` writes a sharded checkpoint
every N steps (atomically: a crash mid-save leaves the previous one loadable), `--resume D`
continues from it bit for bit (same strategy and world size) or resharded (another one). A
checkpoint already in D is never replaced by another run unless `--overwrite` says so.
A NaN or inf loss stops the run naming the step; `--find-nan` also names the first module
that produced it (zl.debug.first_nonfinite). `--fault KIND@STEP[:RANK[:MODULE]]` injects a
fault (raise, exit, kill, hang, nan) so you can watch the job end cleanly.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass

import torch

from . import data, engines, memory, models
from .runtime.comm import Ledger
from .engines.setup import check_same_plan
from .launch import launch, rank, world_size
from .train_checks import (PRECISIONS, available_strategies, check_config, check_plot,  # noqa: F401
                           check_shared_save_dir, parse_fault, plan)


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
    save_every: int = 0          # 0: never save
    save_dir: str | None = None
    resume: str | None = None    # a checkpoint directory to continue from
    overwrite: bool = False      # save_dir may hold a checkpoint of another run: replace it
    find_nan: bool = False       # name the first module that produced a NaN/inf
    fault: str | None = None     # KIND@STEP[:RANK[:MODULE]], see parse_fault
    timeout: float | None = None         # seconds the whole job may take (None: as long as it trains)
    collective_timeout: float = 300.0    # seconds one collective may wait (then the late ranks are named)

    def check(self) -> "TrainConfig":
        """Raise ValueError naming the first field that is wrong (zerolab.train_checks)."""
        check_config(self)
        return self


def make_engine(cfg: TrainConfig, model: torch.nn.Module):
    """Wrap `model` in the engine named by cfg.strategy."""
    optimizer = functools.partial(torch.optim.AdamW, lr=cfg.lr, weight_decay=0.0)
    options = {"precision": cfg.precision}
    if cfg.strategy != "single":      # one process has no buckets
        options["bucket_mb"] = cfg.bucket_mb
    return engines.make(cfg.strategy, model, optimizer, **options)


def train_worker(cfg: TrainConfig, progress=None) -> dict:
    """One rank's training run. Returns its losses, speed, measured memory and bytes sent."""
    torch.manual_seed(cfg.seed)
    model_cfg = models.gpt_config(cfg.size)
    model = models.GPT(model_cfg).to(_device())
    if world_size() > 1:   # before the engine's first collective
        ledger = Ledger(timeout=cfg.collective_timeout)
        check_same_plan(plan(cfg), ledger)
        if cfg.save_every:
            check_shared_save_dir(cfg.save_dir, ledger, rank(), world_size())
    engine = make_engine(cfg, model)
    engine.comm.timeout = cfg.collective_timeout    # the ledger's watchdog: name the rank that is late
    dataset = data.CharDataset(model_cfg.block_size, seed=cfg.seed)
    r, n = rank(), world_size()
    first = 0
    if cfg.resume:
        from . import checkpoint
        first = int(checkpoint.load(engine, cfg.resume).get("data_step", engine.steps))
    fault = parse_fault(cfg.fault, n) if cfg.fault else None
    losses, skipped, report = [], 0, None
    show_bar = progress is None and r == 0 and sys.stderr.isatty()
    bar = _bar(cfg.steps - first) if show_bar else None
    start = time.perf_counter()
    for step in range(first, cfg.steps):
        if cfg.strategy == "single":  # the reference sees the whole global batch
            batch = dataset.batch(step, cfg.batch_size * n)
        else:
            batch = dataset.batch(step, cfg.batch_size, r, n)
        batch = tuple(t.to(_device()) for t in batch)
        if fault is not None and fault[1] == step and fault[2] == r and fault[0] == "nan":
            inject_fault(fault, engine.model)
        last = step == cfg.steps - 1
        with memory.PeakMemory(_device()) if last else _nothing() as peak:  # measure the last step
            _, loss = models.gpt_loss(engine, batch)
            if fault is not None and fault[1] == step and fault[2] == r and fault[0] != "nan":
                inject_fault(fault, engine.model)   # mid-step: the other ranks are entering backward
            _check_finite(cfg, engine, loss, batch, step)
            engine.backward(loss)
            skipped += not engine.step()
        if last:
            report = engine.memory_report()  # before zero_grad, while gradients are held
            report["peak"] = peak.peak
        engine.zero_grad()
        losses.append(loss.item())
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            from . import checkpoint
            # (replace: a DCP checkpoint there is the one this run resumed, or --overwrite said so)
            try:
                checkpoint.save(engine, cfg.save_dir, extra={"data_step": step + 1}, replace=True)
            except checkpoint.CheckpointError as e:      # (a full disk: the step, and the file)
                raise checkpoint.CheckpointError(f"the checkpoint of step {step + 1} was not saved: {e}") from None
        if progress is not None and r == 0:
            progress.put((step + 1 - first, losses[-1]))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    if progress is not None and r == 0:
        # a Queue's put hands the message to a feeder thread; join it, or the process may end
        # before the last step's message is in the pipe (the parent's bar then stops at 3/4)
        progress.close()
        progress.join_thread()
    done = cfg.steps - first
    tokens = done * cfg.batch_size * n * model_cfg.block_size
    if report is None:   # resumed at the end: nothing left to run
        report = dict(engine.memory_report(), peak=0)
    return {"rank": r, "losses": losses, "skipped": skipped, "seconds": elapsed, "first_step": first,
            "tokens_per_s": tokens / elapsed if done else 0.0, "memory": report,
            "bytes_sent": engine.comm.bytes(), "params": models.num_params(model)}


def inject_fault(fault, model=None) -> None:
    """Make the fault `fault` (parse_fault's tuple) happen now, on this rank: what --fault does at its
    step. A fault is a fault wherever it strikes, so tests/test_fault_matrix.py injects through this
    function in each phase of a step (forward, backward, the optimizer's step). `model`: for nan only."""
    kind, step, _, module = fault
    if kind == "raise":
        raise RuntimeError(f"injected fault: rank {rank()} raises at step {step}")
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(3600)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "nan":
        if model is None:
            raise ValueError("fault: nan makes a module's output NaN: give inject_fault the model")
        target = dict(model.named_modules()).get(module or "blocks.0.mlp")
        if target is None:
            raise ValueError(f"fault: the model has no module {module!r}")
        target.register_forward_hook(lambda m, args, out: out * float("nan"))


def _check_finite(cfg, engine, loss, batch, step):
    """Stop on a NaN/inf loss naming the step (and, with find_nan, the first bad module).

    With find_nan every rank learns WHICH ranks have a bad loss (one small all-reduce), so
    they all run the diagnosis forward together (ZeRO-3 gathers parameters inside forward);
    the first bad rank reports, the others stop a moment later pointing at it.
    """
    if cfg.precision == "fp16":   # the loss scaler skips overflowing steps by design
        return
    bad = not bool(torch.isfinite(loss.detach()).all())
    if not cfg.find_nan or cfg.strategy == "single":
        if bad:
            hint = "; rerun with --find-nan to name the first module that produced it" if not cfg.find_nan else ""
            where = ""
            if cfg.find_nan:
                from .runtime.debug import first_nonfinite
                where = f": {first_nonfinite(engine.model, batch[0])}"
            raise FloatingPointError(f"rank {rank()}: the loss is {loss.item()} at step {step}{where}{hint}")
        return
    flags = torch.zeros(world_size(), device=loss.device)
    flags[rank()] = float(bad)
    engine.comm.all_reduce(flags, tag="nan-check")
    bad_ranks = [i for i, f in enumerate(flags.tolist()) if f]
    if not bad_ranks:
        return
    from .runtime.debug import first_nonfinite
    found = first_nonfinite(engine.model, batch[0])  # every rank: ZeRO-3's forward is collective
    if rank() == bad_ranks[0]:
        raise FloatingPointError(f"rank {rank()}: the loss is {loss.item()} at step {step}: "
                                 f"{found if found is not None else 'no module output was non-finite'}")
    time.sleep(2.0)   # let the first bad rank's report reach the launcher first
    raise FloatingPointError(f"rank {rank()}: stopping at step {step}: the loss of rank(s) "
                             f"{bad_ranks} is not finite (see rank {bad_ranks[0]}'s report)")


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
    while done < total:
        try:
            # (once the ranks are done, wait a moment longer: rank 0's last message may still be
            # on its way through the queue's pipe)
            step, loss = queue.get(timeout=2.0 if stop.is_set() else 0.2)
        except Exception:  # queue.Empty, or the queue closed under us
            if stop.is_set():
                break      # (only once the queue is empty: rank 0's last steps are drawn too)
            continue
        if done == 0:
            bar.reset()    # (the clock starts at the first step, not at the ranks' start-up: its rate is the steps')
        bar.update(step - done)
        bar.set_postfix(loss=f"{loss:.3f}")
        done = step
    bar.close()


def run(cfg: TrainConfig, show_progress: bool = True) -> list:
    """Train with `cfg` on cfg.world_size ranks; returns each rank's result dict."""
    cfg.check()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: we are one of the ranks
        return launch(train_worker, cfg.world_size, args=(cfg, None), timeout=cfg.timeout,
                      collective_timeout=cfg.collective_timeout)
    if not show_progress:
        return launch(train_worker, cfg.world_size, args=(cfg, None), timeout=cfg.timeout,
                      collective_timeout=cfg.collective_timeout)
    from .launch import process_context
    queue = process_context().Queue()
    stop = threading.Event()
    total = cfg.steps - _resume_step(cfg)
    follower = threading.Thread(target=_follow_progress, args=(queue, total, stop), daemon=True)
    follower.start()
    try:
        return launch(train_worker, cfg.world_size, args=(cfg, queue), timeout=cfg.timeout,
                      collective_timeout=cfg.collective_timeout)
    finally:
        stop.set()
        follower.join(5.0)


def _resume_step(cfg) -> int:
    if not cfg.resume:
        return 0
    from .checkpoint import describe
    return describe(cfg.resume)[1] or 0


def format_report(cfg: TrainConfig, results: list) -> str:
    """The final report: one block for the run, one line per rank."""
    r0 = results[0]
    resumed = f" (resumed at step {r0['first_step']})" if r0.get("first_step") else ""
    if not r0["losses"]:
        return (f"zerolab train: GPT-{cfg.size}, strategy={cfg.strategy}: the checkpoint is already at "
                f"step {r0.get('first_step')} of {cfg.steps}; nothing to run")
    lines = [
        f"zerolab train: GPT-{cfg.size} ({r0['params']:,} parameters), strategy={cfg.strategy}, "
        f"precision={cfg.precision}, world size {cfg.world_size}, {cfg.steps} steps{resumed}",
        # each step's loss over the global batch: the mean of the ranks' (rank 0's alone would
        # differ from the same run on another number of ranks)
        f"  loss: first {_mean_over_ranks(results, 0):.4f}, last {_mean_over_ranks(results, -1):.4f}"
        + (f", each the mean over the {len(results)} ranks' batches" if len(results) > 1 else "")
        + (f", {r0['skipped']} step(s) skipped on overflow" if r0['skipped'] else ""),
        f"  speed: {sum(r['tokens_per_s'] for r in results) / len(results):,.0f} tokens/s "
        f"(whole job), {r0['seconds'] / len(r0['losses']) * 1e3:.1f} ms per step",
        "  measured per rank (peak: allocated during the last step, above what it started with):",
        "  rank   params        grads         optimizer     total         peak/step     bytes sent",
    ]
    for r in results:
        m = r["memory"]
        lines.append(f"  {r['rank']:>4}   {_mb(m['params'])}  {_mb(m['grads'])}  {_mb(m['optimizer'])}  "
                     f"{_mb(m['total'])}  {_mb(m.get('peak', 0))}  {_mb(r['bytes_sent'])}")
    return "\n".join(lines)


def _mean_over_ranks(results: list, step: int) -> float:
    return sum(r["losses"][step] for r in results) / len(results)


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


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, except where there is none to show (None, a flag)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="tiny", choices=sorted(models.SIZES), help="GPT size")
    parser.add_argument("--strategy", default=None, choices=available_strategies(),
                        help="how the ranks share the work (default: ddp with more than one rank, "
                             "single with one)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS, help="compute precision")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size, MB (ddp, zero1, zero2)")
    parser.add_argument("--plot", default="zerolab-loss.png", help="where to write the loss curve PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="write a sharded checkpoint every N steps (0: never)")
    parser.add_argument("--save-dir", default=None, help="checkpoint directory for --save-every "
                        "(default: zerolab-ckpt when --save-every is given)")
    parser.add_argument("--resume", default=None, metavar="PATH", help="continue from this checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="let --save-dir replace a checkpoint already there (without it, only "
                             "--resume of that same directory writes into it)")
    parser.add_argument("--find-nan", action="store_true",
                        help="on a NaN/inf loss, name the first module that produced it")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before the whole job is ended (default: no limit; a hang is "
                             "caught per collective)")
    parser.add_argument("--collective-timeout", type=float, default=300.0,
                        help="seconds one collective may wait before naming the ranks that did not arrive")
    parser.add_argument("--fault", default=None, help=argparse.SUPPRESS)  # KIND@STEP[:RANK[:MODULE]]


def _resume_hint(cfg, lead: str) -> str:
    """Where to continue from, if a checkpoint was written: "" otherwise."""
    from .checkpoint.files import formats_in
    if cfg.save_dir and os.path.isdir(cfg.save_dir) and formats_in(cfg.save_dir):
        return f"{lead}the last checkpoint is in {cfg.save_dir}; continue with --resume {cfg.save_dir}"
    return ""


def main(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", args.world_size))   # torchrun sets WORLD_SIZE
    strategy = args.strategy or ("ddp" if world > 1 else "single")
    cfg = TrainConfig(size=args.size, strategy=strategy, precision=args.precision, world_size=world,
                      steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      bucket_mb=args.bucket_mb, save_every=args.save_every,
                      save_dir=args.save_dir or ("zerolab-ckpt" if args.save_every else None),
                      resume=args.resume, overwrite=args.overwrite, find_nan=args.find_nan, fault=args.fault, timeout=args.timeout,
                      collective_timeout=args.collective_timeout)
    try:
        cfg.check()
        if rank() == 0:
            check_plot(args.plot)
    except ValueError as exc:
        print(f"zerolab train: error: {exc}", file=sys.stderr)
        return 2
    from .launch import LaunchError
    try:
        results = run(cfg, show_progress=not args.no_progress)
    except KeyboardInterrupt:   # Ctrl-C: the ranks are stopped already (zl.launch); one line, no traceback
        if rank() == 0:
            print(f"zerolab train: interrupted{_resume_hint(cfg, ': ')}", file=sys.stderr)
        return 130
    except Exception as exc:   # noqa: BLE001 - reported below, with where to resume from
        said = next((line for line in str(exc).splitlines() if "CheckpointError: " in line), None)
        if isinstance(exc, LaunchError) and said is not None:
            exc = f"rank {exc.rank}: {said.split('CheckpointError: ', 1)[1]}"   # (says what and where: no traceback)
        elif not isinstance(exc, LaunchError):
            if "RANK" not in os.environ:
                raise               # a bug of this process, not a rank's failure
            exc = f"rank {rank()}: {type(exc).__name__}: {exc}"   # under torchrun: this rank's own
        print(f"zerolab train: error: {exc}", file=sys.stderr)
        hint = _resume_hint(cfg, "")
        if hint:
            print(f"zerolab train: {hint}", file=sys.stderr)
        return 1
    if rank() == 0:
        print(format_report(cfg, results))
        if args.plot:
            plot_losses(results, args.plot, f"GPT-{cfg.size}, {cfg.strategy}, {cfg.precision}")
            print(f"  loss curve: {args.plot}")
        print("  config:", asdict(cfg))
    return 0
