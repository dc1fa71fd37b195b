"""zl.checkpoint.save's writing half: one rank's shard and the files it links, then rank 0's
metadata, written last. See zerolab.checkpoint for the layout of a checkpoint directory.

Every file is created exclusively under a temporary name, synced and renamed into place
(zerolab.checkpoint.atomic), so a crash leaves either the old file or the new one, and a link
planted at the temporary name is never followed. Nothing a failed save wrote outlives it: a
temporary file goes on any error (a full disk, Ctrl-C); a rank whose shard cannot be written says
so to every rank before the metadata is written, and then every rank removes the files it wrote
for this save (remove_unpublished). A save killed outright (SIGKILL) leaves its files to the next
save, which removes every file the new metadata does not name.

Before anything is trained, check_save_dir and probe_save_dir say whether a save could write
into a directory at all (probe_save_dir by writing a file there and removing it).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import secrets
import shutil

import torch

from .atomic import create_exclusive, new_file, write_atomically
from .files import MAX_EXTRA_BYTES, MAX_EXTRA_PICKLE, encode_metadata, zip_sizes
from .reader import FORMAT, METADATA, CheckpointError, _check_path, file_digest


def check_save_dir(path) -> str:
    """Raise CheckpointError now (before training) unless `path` is, or can become, a writable
    directory: a save that fails only at step 1000 loses 1000 steps."""
    path = _check_path(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: exists and is not a directory; checkpoints are directories")
    parent = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{path}: cannot write there ({parent} is not writable)")
    return path


def probe_save_dir(path) -> str:
    """check_save_dir, then the proof: the directory is made if it is missing, a file is written
    into it and removed, and every directory made is removed again. (os.access says yes to /proc
    and to read-only mounts for root; only a write tells.)"""
    path = check_save_dir(path)
    made, at = [], os.path.abspath(path)
    while not os.path.exists(at):
        made.append(at)
        at = os.path.dirname(at)
    probe = os.path.join(path, f".zerolab-probe-{secrets.token_hex(8)}")
    try:
        os.makedirs(path, exist_ok=True)
        os.close(create_exclusive(probe, 0o600))
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write a checkpoint there ({e.strerror})") from None
    finally:
        for d in made:                       # the deepest first
            try:
                os.rmdir(d)
            except OSError:
                pass
    return path


def _atomic_write(path: str, data: bytes) -> None:
    write_atomically(path, data)


def _link(src: str, directory: str, name: str) -> dict:
    """Put file `src` (an offload file) into the checkpoint as `name` without reading it into
    memory: a hard link (no byte copied) where both are on one file system, else a copy. The
    offload engine replaces its files and never writes one in place, so the link keeps the
    bytes of this save. Returns the file's entry in the metadata: name, size and SHA-256."""
    dst = os.path.join(directory, name)
    try:
        os.link(src, dst)           # (fails, and follows nothing, if anything is at dst)
    except OSError:                 # another file system, or one without hard links
        with open(src, "rb") as source, new_file(dst) as copy:
            shutil.copyfileobj(source, copy)
    fd = os.open(dst, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)                # (the engine never syncs its files; a checkpoint must survive a power cut)
    finally:
        os.close(fd)
    size, sha256 = file_digest(dst)
    return {"file": name, "bytes": size, "sha256": sha256}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _check_extra(extra: dict) -> None:
    """`extra` within its bounds (zerolab.checkpoint.files): every loader reads it back."""
    stack, seen, tensor_bytes = [extra], set(), 0
    while stack:                          # the tensors first: counted without copying them
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                tensor_bytes += storage.nbytes()
        elif isinstance(x, dict):
            stack += x.values()
        elif isinstance(x, (list, tuple)):
            stack += x
    pickled = 0
    if tensor_bytes <= MAX_EXTRA_BYTES:
        buf = io.BytesIO()
        torch.save(extra, buf)
        pickled, tensor_bytes = zip_sizes(buf.getvalue(), "extra")
    if tensor_bytes > MAX_EXTRA_BYTES or pickled > MAX_EXTRA_PICKLE:
        raise CheckpointError(
            f"checkpoint.save: extra holds {tensor_bytes / 2**20:.1f} MiB of tensors and {pickled / 2**20:.1f} MiB "
            f"of other values; at most {MAX_EXTRA_BYTES >> 20} MiB and {MAX_EXTRA_PICKLE >> 20} MiB: extra is for a "
            "data position and a few counters (save large state in files of your own)")


def write(engine, path, extra, sid, kind, rank, size, opt_segments, frozen_segments, mine, agree) -> str:
    """This rank's shard (and the files it links), then rank 0's metadata; `mine` collects the
    names of the files written, agree(value, op) is one int agreed by every rank."""
    failure = None
    try:
        _write_shard(engine, path, extra, sid, rank, size, opt_segments, frozen_segments, mine)
    except Exception as e:  # noqa: BLE001 - a full disk, an extra too large: every rank must hear of it
        failure = e
        if isinstance(e, OSError):      # (a full disk, a read-only file system: one line naming the file)
            failure = CheckpointError(f"{e.filename or path}: cannot write rank {rank}'s shard ({e.strerror or e}); "
                                      "every rank has given up this save; the previous checkpoint, if any, stands")
    # every shard is on disk before rank 0 writes the metadata that names them; a rank that could
    # not write its shard says so here, and every rank gives up this save (api.save removes its files)
    first_failed = agree(size if failure is None else rank, "min")
    if failure is not None:
        raise failure
    if first_failed < size:
        raise CheckpointError(f"{path}: rank {first_failed} could not write its shard (its error says why); "
                              "every rank has given up this save and removed its files; the previous "
                              "checkpoint, if any, stands")
    meta_path = os.path.join(path, METADATA)
    problem = None
    if rank == 0:
        try:
            _publish(engine, path, kind, size, sid)
        except CheckpointError as e:
            problem = e
        except OSError as e:            # (a full disk as the metadata is written)
            problem = CheckpointError(f"{e.filename or os.path.join(path, METADATA)}: cannot write the metadata "
                                      f"({e.strerror or e}); the previous checkpoint, if any, stands")
    # nobody returns before the metadata is in place, and every rank learns whether it is
    if agree(int(problem is None), "min") == 0:
        raise problem or CheckpointError(
            f"{path}: rank 0 could not find every rank's shard in this directory: the ranks must save "
            "into one directory they all share (a shared file system), not one per node")
    return meta_path


def _write_shard(engine, path, extra, sid, rank, size, opt_segments, frozen_segments, mine) -> None:
    """This rank's shard file and its descriptor (what rank 0 puts into the metadata)."""
    _check_extra(extra or {})
    os.makedirs(path, exist_ok=True)
    optimizer = engine.optimizer
    pieces = []
    in_files = engine.checkpoint_files()   # offload="disk": tensors whose bytes are in files
    linked: dict = {}                      # such a file -> its entry in this shard's "files"
    state_dtypes: dict = {}                # optimizer state key -> the dtype it is saved in

    def values(t, t_lo, n, cast):
        """Elements [t_lo, t_lo + n) of t: a CPU copy, or where they are in a linked file."""
        if id(t) not in in_files:
            v = t.detach().reshape(-1)[t_lo:t_lo + n]
            return (v.float() if cast else v).cpu().clone()
        src, offset = in_files[id(t)]
        if src not in linked:
            name = f"shard-{sid}-{rank:05d}-{os.path.basename(src)}"
            mine.append(name)
            linked[src] = _link(src, path, name)
        return {"file": linked[src]["file"], "dtype": str(t.dtype).replace("torch.", ""),
                "offset": offset + t_lo}

    with torch.no_grad():
        for t, t_lo, name, lo, hi in opt_segments:
            n = hi - lo
            piece = {"name": name, "lo": lo, "hi": hi, "value": values(t, t_lo, n, True),
                     "state": {}, "scalars": {}}
            for k, v in optimizer.state.get(t, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == t.shape:
                    piece["state"][k] = values(v, t_lo, n, False)
                    dtype = str(v.dtype).replace("torch.", "")
                    if state_dtypes.setdefault(k, dtype) != dtype:
                        raise CheckpointError(f"checkpoint.save: optimizer state {k!r} is {state_dtypes[k]} "
                                              f"for one tensor and {dtype} for another")
                else:
                    piece["scalars"][k] = v.cpu().clone() if isinstance(v, torch.Tensor) else v
            pieces.append(piece)
        for t, t_lo, name, lo, hi in frozen_segments:
            pieces.append({"name": name, "lo": lo, "hi": hi, "state": {}, "scalars": {},
                           "value": values(t, t_lo, hi - lo, True)})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    content = {
        "format": FORMAT, "rank": rank, "world_size": size, "pieces": pieces,
        "buffers": ({n: b.detach().cpu().clone() for n, b in engine.model.named_buffers()}
                    if rank == 0 else {}),
        "steps": int(engine.steps), "precision": engine.precision.state_dict(),
        "param_groups": groups, "rng": _rng_state(), "extra": extra or {},
    }
    buf = io.BytesIO()
    torch.save(content, buf)
    data = buf.getvalue()
    fname = f"shard-{sid}-{rank:05d}-of-{size:05d}.pt"
    mine += [fname, fname + ".json"]
    _atomic_write(os.path.join(path, fname), data)
    desc = {"file": fname, "rank": rank, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "pieces": [[p["name"], p["lo"], p["hi"]] for p in pieces], "files": list(linked.values()),
            "state": state_dtypes}
    _atomic_write(os.path.join(path, fname + ".json"), json.dumps(desc).encode())


def _publish(engine, path, kind, size, sid) -> None:
    """Rank 0: the metadata that names every rank's shard, written last; then the files of
    earlier saves go."""
    shards = []
    for r in range(size):
        desc = os.path.join(path, f"shard-{sid}-{r:05d}-of-{size:05d}.pt.json")
        try:
            with open(desc) as f:
                shards.append(json.load(f))
        except FileNotFoundError:
            raise CheckpointError(
                f"{path}: rank {r}'s shard is not in this directory as rank 0 sees it ({os.path.basename(desc)} "
                "missing): the ranks must save into one directory they all share (a shared file "
                "system), not one per node") from None
    model = engine.model
    sd = model.state_dict(keep_vars=True)
    names = {id(p): n for n, p in model.named_parameters()}   # a tied weight: its first name
    meta = {
        "format": FORMAT, "engine": kind, "world_size": size, "steps": int(engine.steps),
        "precision": engine.precision.name,
        "params": {n: {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
                       "trainable": p.requires_grad} for n, p in model.named_parameters()},
        "buffers": {n: {"shape": list(b.shape), "dtype": str(b.dtype).replace("torch.", "")}
                    for n, b in model.named_buffers()},
        # state_dict key -> the parameter it is (tied weights: several keys, one name)
        "keys": {k: names.get(id(t), k) for k, t in sd.items()},
        "shards": shards,
    }
    _atomic_write(os.path.join(path, METADATA), encode_metadata(meta))
    # the new checkpoint is in place: shards of earlier saves are garbage now
    keep = {s["file"] for s in shards} | {s["file"] + ".json" for s in shards} | {METADATA}
    keep |= {f["file"] for s in shards for f in s["files"]}
    # (every rank has renamed its shard into place, so a file still named *.tmp-PID is left
    # over from a save that was interrupted: it goes too)
    for f in os.listdir(path):
        if (f.startswith("shard-") and f not in keep) or f.startswith(METADATA + ".tmp-"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, f))


def remove_unpublished(path, mine) -> None:
    """After a failed save: remove the files it wrote, unless the metadata names them already
    (rank 0 published before another rank failed: they are the checkpoint now)."""
    try:
        fd = os.open(os.path.join(path, METADATA), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            published = f.read(64 << 20)
    except OSError:
        published = ""
    for name in mine:
        if name.removesuffix(".json") not in published:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, name))

