"""What `python -m zerolab train` checks before it trains, so that no run fails at step 1000
for a reason it could have named at step 0.

In the parent (or each torchrun process), before any rank starts:
    check_config(cfg)         every field: ranges, choices, timeouts, the fault spec, the
                              checkpoint to resume (read and verified), the save directory
                              (writable: tried; a checkpoint already there is replaced only by
                              the run that resumes it, or with overwrite), the plot's file (its
                              directory exists), the batch (a step's logits must fit this
                              machine's memory)
In every rank, before the engine's first collective:
    plan(cfg)                 what all ranks must agree on (zerolab.engines.setup.check_same_plan
                              compares it): under torchrun each node parses its own command line.
                              The checkpoint to resume is named by its identity (step and digest),
                              not by a flag: ranks resuming different checkpoints would train a mix
    check_shared_save_dir()   every rank writes into the save directory and sees the others'
                              files there: one directory shared by all nodes, or no checkpoint
"""

from __future__ import annotations

import math
import os
import secrets

import torch

from . import engines, models
from .checkpoint.atomic import create_exclusive, signals_held, stopping_cleanly
from .checkpoint.files import CheckpointError, formats_in
from .checkpoint.writer import check_save_dir, probe_save_dir
from .runtime.watchdog import check_timeout

PRECISIONS = ("fp32", "bf16", "fp16")
FAULTS = ("raise", "exit", "kill", "hang", "stop", "nan")
MAX_LR = 10.0     # AdamW moves every weight by about lr a step: beyond this a run only diverges


def available_strategies() -> list:
    """The engines --strategy can name (zerolab.engines; NaiveDDP is chapter 5's teaching version)."""
    return [name for name in engines.NAMES if name != "naive"]


def _number(value, low_ok) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        (value >= 0 if low_ok else value > 0)


def check_config(cfg) -> None:
    """Raise ValueError naming the first field of `cfg` (a TrainConfig) that is wrong."""
    models.gpt_config(cfg.size)  # raises on an unknown size
    if cfg.strategy not in available_strategies():
        raise ValueError(f"unknown strategy {cfg.strategy!r}; choose one of {available_strategies()}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg.precision!r}; choose one of {list(PRECISIONS)}")
    for name in ("world_size", "steps", "batch_size"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if not _number(cfg.lr, low_ok=False):
        raise ValueError(f"lr must be a finite number > 0, got {cfg.lr!r}")
    if cfg.lr > MAX_LR:
        raise ValueError(f"lr must be at most {MAX_LR:g}, got {cfg.lr!r}: AdamW moves every weight by about lr "
                         "a step, so a larger one only diverges (and above ~3e37 overflows fp32)")
    if not _number(cfg.bucket_mb, low_ok=False):
        raise ValueError(f"bucket_mb must be a finite number > 0, got {cfg.bucket_mb!r}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {cfg.seed!r}")
    if isinstance(cfg.save_every, bool) or not isinstance(cfg.save_every, int) or cfg.save_every < 0:
        raise ValueError(f"save_every must be an int >= 0 (0 = never), got {cfg.save_every!r}")
    if cfg.save_every and not cfg.save_dir:
        raise ValueError("save_every needs save_dir: the directory to write checkpoints into")
    check_batch_fits(cfg)
    if cfg.save_dir:
        try:
            probe_save_dir(cfg.save_dir)     # now, not at the first save: a file written and removed
        except CheckpointError as e:
            raise ValueError(f"save_dir: {e}") from None
    if cfg.save_every and cfg.save_dir:
        check_no_overwrite(cfg)
    if cfg.resume is not None:
        if not os.path.isdir(cfg.resume) or not formats_in(os.fspath(cfg.resume)):
            raise ValueError(f"resume: {cfg.resume} holds no checkpoint (neither zerolab's metadata.json nor "
                             "a torch.distributed.checkpoint's .metadata); pass a directory written by "
                             "--save-dir or zl.checkpoint.save (a save that never finished leaves none)")
        try:
            identity(cfg.resume)             # the metadata read and verified (its digest)
        except CheckpointError as e:
            raise ValueError(f"resume: {e}") from None
    check_timeout(cfg.collective_timeout, "collective_timeout", allow_none=False, where="")
    check_timeout(cfg.timeout, "timeout", allow_none=True, where="")
    if cfg.fault is not None:
        parse_fault(cfg.fault, cfg.world_size)


def check_no_overwrite(cfg) -> None:
    """A checkpoint already in save_dir is another run's work: only the run that resumes it (resume
    names the same directory) or an explicit overwrite may replace it."""
    if cfg.overwrite or not os.path.isdir(cfg.save_dir) or not formats_in(cfg.save_dir):
        return
    if cfg.resume is not None and os.path.isdir(cfg.resume) and os.path.samefile(cfg.resume, cfg.save_dir):
        return
    try:
        what = f"a checkpoint ({identity(cfg.save_dir).split(',')[0]})"
    except CheckpointError:
        what = "a checkpoint"
    raise ValueError(f"save_dir: {cfg.save_dir} holds {what} already; pass --resume {cfg.save_dir} to "
                     "continue it, or --overwrite to replace it")


def _memory_per_rank(ranks: int) -> int:
    """Bytes of memory each of `ranks` processes on this machine may have: the machine's (or its
    container's, when a cgroup limits it) divided among them."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total // max(1, ranks)


def check_batch_fits(cfg) -> None:
    """A step's logits (batch x block x vocabulary floats) and the log-probabilities cross-entropy
    keeps for backward must fit this machine's memory: a lower bound of what a step needs, so a
    batch that could fit is never refused, and one that cannot is refused now rather than after
    the ranks have spent a minute allocating it."""
    model = models.gpt_config(cfg.size)
    rows = cfg.batch_size * (cfg.world_size if cfg.strategy == "single" else 1)
    need = 2 * rows * model.block_size * model.vocab_size * 4
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size))   # (torchrun: the ranks of this node)
    have = _memory_per_rank(ranks)
    if need > have:
        raise ValueError(f"batch_size {cfg.batch_size}: one step needs at least {_bytes(need)} per rank "
                         f"(the logits and their log-probabilities: {rows:,} x {model.block_size} x "
                         f"{model.vocab_size} floats each), more than the {_bytes(have)} each of "
                         f"{ranks:,} rank(s) has on this machine; lower --batch-size"
                         f"{' or --world-size' if ranks > (os.cpu_count() or 1) else ''}")


def _bytes(n: int) -> str:
    """n bytes in the largest binary unit that leaves a number of at least 1 (0.0 GiB says nothing)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} bytes"


def check_plot(path) -> None:
    """The loss curve's PNG must be writable where it is asked for: checked before training,
    not after it."""
    if not path:
        return
    if os.path.isdir(path):
        raise ValueError(f"plot: {path!r} is a directory; give a file name such as loss.png")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"plot: the directory {parent!r} does not exist; create it, or pass --plot '' "
                         "for no plot")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"plot: cannot write into {parent!r}")


def parse_fault(spec: str, world_size: int) -> tuple:
    """'kill@3:1' -> ("kill", 3, 1, None): at step 3, rank 1 kills itself. RANK defaults to 0.

    raise: an exception; exit: os._exit(3); kill: SIGKILL to itself; hang: sleeps an hour
    (the collective timeout names it); stop: SIGSTOP to itself (frozen: only SIGKILL or SIGCONT
    reach it, as a machine that stopped answering); nan@STEP:RANK:MODULE: that module's output becomes
    NaN from that step on (MODULE defaults to the first transformer block's MLP).
    """
    try:
        kind, rest = spec.split("@", 1)
        parts = rest.split(":")
        step, who = int(parts[0]), int(parts[1]) if len(parts) > 1 and parts[1] else 0
        module = parts[2] if len(parts) > 2 else None
    except (ValueError, AttributeError):
        raise ValueError(f"fault must look like KIND@STEP[:RANK[:MODULE]] (e.g. kill@3:1), got {spec!r}") from None
    if kind not in FAULTS:
        raise ValueError(f"fault: unknown kind {kind!r}; choose one of {list(FAULTS)}")
    if step < 0 or not 0 <= who < world_size:
        raise ValueError(f"fault: step must be >= 0 and rank in [0, {world_size}), got {spec!r}")
    return kind, step, who, module


def plan(cfg) -> dict:
    """What every rank must agree on before training: under torchrun each node parses its own
    command line, and ranks planning different runs would wait for each other forever, or
    (resuming different checkpoints) train a mixture of two models."""
    return {k: getattr(cfg, k) for k in ("size", "strategy", "precision", "steps", "batch_size", "lr",
                                         "seed", "bucket_mb", "save_every", "find_nan", "fault")} | \
        {"resume": None if cfg.resume is None else identity(cfg.resume)}


def identity(path) -> str:
    """The checkpoint in `path`, in one line (its step and digest), either format."""
    from .checkpoint import describe
    return describe(path)[2]


def check_shared_save_dir(path, ledger, rank: int, world: int) -> None:
    """Every rank writes a file into `path` and looks for every other rank's: a directory that
    is not the same for all (one per node, not shared) is refused now, on every rank alike,
    instead of failing at the first save. Collective: every rank calls it."""
    def agree(value: int, op: str) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        ledger.all_reduce(t, op=op, tag="setup")
        return int(t.item())

    token = agree(secrets.randbits(62) if rank == 0 else 0, "max")
    mine = os.path.join(path, f".zerolab-probe-{token:016x}-{rank}")
    # (a launcher stops the other ranks with SIGTERM when one fails: the probe goes all the same)
    with stopping_cleanly():
        try:
            _probe_shared(path, mine, token, agree, rank, world)
        finally:
            with signals_held():
                if os.path.lexists(mine):
                    os.remove(mine)


def _probe_shared(path, mine, token, agree, rank, world) -> None:
    try:
        check_save_dir(path)
        os.makedirs(path, exist_ok=True)
        os.close(create_exclusive(mine))
        wrote = 1
    except (OSError, CheckpointError):
        wrote = 0
    failed = agree(world if wrote else rank, "min")
    if failed < world:
        raise ValueError(f"save_dir {path!r}: rank {failed} cannot write there; every rank must be "
                         "able to write the checkpoint directory")
    sees = all(os.path.exists(os.path.join(path, f".zerolab-probe-{token:016x}-{r}")) for r in range(world))
    blind = agree(world if sees else rank, "min")
    if blind < world:
        raise ValueError(f"save_dir {path!r}: rank {blind} does not see the files the other ranks "
                         "write there: every rank must save into one directory that all nodes share "
                         "(a shared file system), not a directory of its own")
