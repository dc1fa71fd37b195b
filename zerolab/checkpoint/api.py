"""zl.checkpoint.save, load and consolidate: what each rank writes and reads (see the package's
docstring for the layout on disk)."""


from __future__ import annotations

import os
import random
import secrets
import shutil

import torch

from . import dcp
from . import writer as checkpoint_writer
from .atomic import replace_directory, signals_held, stopping_cleanly
from .dcp_reader import DcpReader
from .files import check_other_format, format_of
from .reader import METADATA, CheckpointError, Reader, _check_path  # noqa: F401 (CheckpointError: zl.checkpoint.CheckpointError)
from .writer import check_save_dir
from .validate import check_fits
from .ranks import agree, check_same_checkpoint, dist_rank, engine_kind, rank_size, refuse_together


# ------------------------------------------------------------------ what each engine owns
#
# A segment says: elements [t_lo, t_lo + hi - lo) of tensor.view(-1) are elements [lo, hi) of
# parameter `name` (flattened). Every engine describes itself by two lists of segments
# (Engine.checkpoint_segments, via optimizer_segments):
#   opt     the tensors the optimizer updates (fp32 masters), with their optimizer state
#   frozen  frozen parameters this rank holds
# and says which are replicated (held whole by every rank: then each rank writes 1/N of them).


def _names(model) -> dict:
    """id(parameter) -> its name (the first name of a tied weight)."""
    return {id(p): n for n, p in model.named_parameters()}


def _split(segments, rank, size):
    """Rank `rank`'s 1/size of every segment (replicated engines write each element once)."""
    out = []
    for t, t_lo, name, lo, hi in segments:
        step = -(-(hi - lo) // size)
        a, b = lo + rank * step, min(hi, lo + (rank + 1) * step)
        if a < b:
            out.append((t, t_lo + a - lo, name, a, b))
    return out


def _refresh_compute(engine, reader):
    """After the masters are loaded: make the compute copies (what forward uses) match them."""
    names = _names(engine.model)
    engine.refresh_compute(lambda flat, p: reader.fill(flat, names[id(p)], 0, p.numel(), "value"))


# ------------------------------------------------------------------ saving (zerolab.checkpoint.writer)


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _check_no_model_parallelism(engine, action):
    # Under a Mesh with mp > 1 the mp ranks hold DIFFERENT shards of each tensor-parallel
    # weight under the same name and the same dp rank: their files and pieces would collide.
    mesh = getattr(engine, "mesh", None)
    if mesh is not None and mesh.mp > 1:
        raise CheckpointError(f"checkpoint.{action}: the engine runs on a Mesh with mp={mesh.mp}; "
                              "checkpoints of tensor-parallel models are not supported (each mp rank "
                              "holds different shards under the same parameter names). Save "
                              "engine.full_state_dict() per mp rank yourself, or train with mp=1.")


def save(engine, path, extra: dict | None = None, *, format: str = "zerolab", replace: bool = False) -> str:
    """Every rank writes its own shard of `engine` into directory `path`; returns the metadata path.

    `extra` (ints, floats, strings, lists, dicts, tensors) is stored per rank and returned by
    load(): put the data position there. Every rank of the engine must call save.
    format="dcp": a torch.distributed.checkpoint directory, which FSDP2 loads (checkpoint.dcp).
    A directory holding a checkpoint of the other format is refused unless replace=True: then the
    new checkpoint is written beside it and put in its place whole when complete.
    """
    if format != "zerolab":
        return dcp.save(engine, path, extra, format=format, replace=replace)
    dcp.check_own_format(engine, "save")
    path = check_save_dir(path)
    kind = engine_kind(engine)
    _check_no_model_parallelism(engine, "save")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"checkpoint.save: extra must be a dict or None, got {type(extra).__name__}")
    if kind == "single" and dist_rank(engine) != 0:
        return os.path.join(path, METADATA)   # replicas of the reference: rank 0 speaks for all
    problem, replacing = None, False
    try:                                      # every rank, before the first collective of the save
        replacing = check_other_format(path, "zerolab", replace)
    except CheckpointError as e:
        problem = e
    refuse_together(engine, path, problem, "cannot save there")
    rank, size = rank_size(engine)
    opt_segments, frozen_segments, opt_replicated, frozen_replicated = \
        engine.optimizer_segments(_names(engine.model))
    if opt_replicated:
        opt_segments = _split(opt_segments, rank, size)
    if frozen_replicated:
        frozen_segments = _split(frozen_segments, rank, size)
    replicas = getattr(engine, "replicas", 1)
    if replicas > 1:
        # HSDP: every node holds the same shards; node i writes the i-th 1/replicas of each piece
        index = engine.replica_index
        opt_segments = _split(opt_segments, index, replicas)
        frozen_segments = _split(frozen_segments, index, replicas)
    mine: list = []     # the files this save has written: removed if it fails before it is published
    # (a launcher stops the other ranks of a failed job with SIGTERM: they remove their files first)
    target = path
    with stopping_cleanly():
        try:
            # one fresh id per save, the same on every rank: rank 0's random number wins
            token = agree(engine, secrets.randbits(62) if rank == 0 else 0, "max")
            sid = f"{engine.steps:08d}-{token:016x}"
            # replacing the other format: the new checkpoint is written whole beside it, then swapped in
            target = f"{path.rstrip(os.sep)}.tmp-{sid}" if replacing else path
            checkpoint_writer.write(engine, target, extra, sid, kind, rank, size, opt_segments,
                                    frozen_segments, mine, lambda value, op: agree(engine, value, op))
            if replacing:
                problem = None
                if rank == 0:
                    try:
                        replace_directory(target, path.rstrip(os.sep))
                    except OSError as e:
                        problem = CheckpointError(f"{path}: the new checkpoint could not replace the old one "
                                                  f"({e.strerror}); the old one stands")
                refuse_together(engine, path, problem, "could not put the new checkpoint in place")
            return os.path.join(path, METADATA)
        except BaseException:
            with signals_held():
                checkpoint_writer.remove_unpublished(target, mine)
                if target != path and rank == 0:
                    shutil.rmtree(target, ignore_errors=True)
            raise


# ------------------------------------------------------------------ loading


def load(engine, path) -> dict:
    """Restore `engine` from the checkpoint in `path`; returns this rank's `extra` dict.

    Same world size and engine: the run continues bit for bit as if it had never stopped (RNG
    states included). Another world size or stage: parameters and optimizer state are
    resharded from the metadata (step counts, scaler and `extra` come from rank 0's shard).
    Every rank of the engine must call load, with the same checkpoint: the ranks compare its step
    and digest first, and refuse together (naming each rank's directory and step) if they differ;
    a checkpoint that any rank refuses changes no rank.
    A torch.distributed.checkpoint directory (FSDP2's, torchtitan's, or save(format="dcp")) is
    read by checkpoint.dcp.
    """
    if format_of(path) == "dcp":
        return dcp.load(engine, path)
    dcp.check_own_format(engine, "load")
    path = _check_path(path)
    kind = engine_kind(engine)
    _check_no_model_parallelism(engine, "load")
    rank, size = rank_size(engine)
    # read and check everything before changing anything (zerolab.checkpoint.validate), and
    # agree with every rank that it is the same checkpoint and that it fits, before any rank changes
    try:
        reader, problem = Reader(path), None
    except CheckpointError as e:
        reader, problem = None, e
    seen = None if reader is None else (f"step {reader.meta['steps']} (sha256 {reader.meta['sha256'][:12]})",
                                        f"{reader.meta['steps']}:{reader.meta['sha256']}")
    check_same_checkpoint(engine, path, seen, problem)
    if problem is not None:
        raise problem
    same = reader.meta["world_size"] == size and reader.meta["engine"] == kind
    own = rank if reader.meta["world_size"] == size else 0
    opt_segments, frozen_segments, _, _ = engine.optimizer_segments(_names(engine.model))
    try:
        check_fits(engine, reader, own, opt_segments, restore_rng=same)
    except CheckpointError as e:
        problem = e
    refuse_together(engine, path, problem)
    info = reader.shard(own)
    optimizer = engine.optimizer
    with torch.no_grad():
        by_tensor: dict = {}
        for seg in opt_segments:
            by_tensor.setdefault(id(seg[0]), (seg[0], []))[1].append(seg)
        for t, segs in by_tensor.values():
            with engine.resident(t):    # (offload="disk": one unit's master in memory at a time)
                _load_tensor(optimizer, reader, t, segs)
        for t, t_lo, name, lo, hi in frozen_segments:
            tmp = torch.empty(hi - lo)
            reader.fill(tmp, name, lo, hi, "value")
            with engine.resident(t):
                t.data.view(-1)[t_lo:t_lo + hi - lo].copy_(tmp)
        buffers = reader.shard(0)["buffers"]
        for n, b in engine.model.named_buffers():
            b.copy_(buffers[n])
        for g, saved in zip(optimizer.param_groups, info["param_groups"]):
            # hyperparameters only (lr, weight decay...), range-checked: what the optimizer
            # updates and how (maximize, amsgrad...) are the engine's
            g.update({k: v for k, v in saved.items() if k in g and k != "params"})
        _refresh_compute(engine, reader)
    engine.steps = int(info["steps"])
    engine.precision.load_state_dict(info["precision"])
    if same:
        _set_rng_state(info["rng"])
    return dict(info["extra"])


def _load_tensor(optimizer, reader, t, segs) -> None:
    """One tensor the optimizer updates, and its optimizer state, from the pieces over `segs`."""
    flat = t.data.view(-1)
    keys, scalars, any_state = set(), {}, False
    for _, t_lo, name, lo, hi in segs:
        reader.fill(flat[t_lo:t_lo + hi - lo], name, lo, hi, "value")
        for piece, _, _ in reader.pieces(name, lo, hi):
            keys |= set(piece["state"])
            for k, v in piece["scalars"].items():
                scalars.setdefault(k, v)
            any_state = any_state or bool(piece["state"]) or bool(piece["scalars"])
    optimizer.state.pop(t, None)
    if any_state:
        state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
        for k in sorted(keys):
            # padding and pieces without this state stay zero, as in a fresh shard
            state[k] = torch.zeros_like(t)
            for _, t_lo, name, lo, hi in segs:
                reader.fill(state[k].view(-1)[t_lo:t_lo + hi - lo], name, lo, hi, k, must_cover=False)
        optimizer.state[t] = state


def describe(path) -> tuple:
    """(format, steps, identity) of the checkpoint in `path`, its metadata read and verified (not
    its tensors): "zerolab" or "dcp", the step it was saved at (None for a DCP directory zerolab did
    not write), and the one line the ranks that load it compare."""
    if format_of(path) == "dcp":
        reader = DcpReader(path)
        return "dcp", reader.steps, reader.identity
    reader = Reader(path)
    return "zerolab", reader.meta["steps"], reader.identity()


def consolidate(path) -> dict:
    """The full fp32 state dict (original keys, no padding, tied weights shared), no processes.
    A torch.distributed.checkpoint directory: its model's weights (checkpoint.dcp.consolidate)."""
    if format_of(path) == "dcp":
        return dcp.consolidate(path)
    reader = Reader(path)
    reader.check_all()
    full = {}
    for name, info in reader.meta["params"].items():
        numel = 1
        for d in info["shape"]:
            numel *= d
        t = torch.empty(numel, dtype=torch.float32)
        reader.fill(t, name, 0, numel, "value")
        full[name] = t.view(info["shape"])
    buffers = reader.shard(0)["buffers"]
    out = {}
    for key, name in reader.meta["keys"].items():
        if name in full:
            out[key] = full[name]
        elif key in buffers:
            b = buffers[key]
            out[key] = b.float() if b.is_floating_point() else b
        else:
            raise CheckpointError(f"{reader.meta_path}: state_dict key {key!r} is neither a saved "
                                  "parameter nor a saved buffer")
    return out
