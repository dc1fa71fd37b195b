"""zl.checkpoint.save's writing half: one rank's shard and the files it links, then rank 0's
metadata, written last. See zerolab.checkpoint for the layout of a checkpoint directory.

Every file is written under a temporary name, synced and renamed into place (_atomic_write), so
a crash leaves either the old file or the new one. Nothing a failed save wrote outlives it: a
temporary file goes on any error (a full disk, Ctrl-C), and the shard of a save that never
published its metadata is removed by the rank that wrote it (remove_unpublished); a save killed
outright (SIGKILL) leaves its files to the next save, which removes every file the new
metadata does not name.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil

import torch

from .files import with_digest
from .reader import FORMAT, METADATA, CheckpointError, file_digest


@contextlib.contextmanager
def _removed_on_error(*paths):
    """Files that must not outlive an error inside the block (a full disk, an interrupt)."""
    try:
        yield
    except BaseException:
        for path in paths:
            with contextlib.suppress(OSError):
                os.remove(path)
        raise


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with _removed_on_error(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _link(src: str, directory: str, name: str) -> dict:
    """Put file `src` (an offload file) into the checkpoint as `name` without reading it into
    memory: a hard link (no byte copied) where both are on one file system, else a copy. The
    offload engine replaces its files and never writes one in place, so the link keeps the
    bytes of this save. Returns the file's entry in the metadata: name, size and SHA-256."""
    dst = os.path.join(directory, name)
    try:
        os.link(src, dst)
    except OSError:                 # another file system, or one without hard links
        tmp = f"{dst}.tmp-{os.getpid()}"
        with _removed_on_error(tmp):
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
    with open(dst, "rb") as f:
        os.fsync(f.fileno())        # (the engine never syncs its files; a checkpoint must survive a power cut)
    size, sha256 = file_digest(dst)
    return {"file": name, "bytes": size, "sha256": sha256}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def write(engine, path, extra, sid, kind, rank, size, opt_segments, frozen_segments, mine, agree) -> str:
    """This rank's shard (and the files it links), then rank 0's metadata; `mine` collects the
    names of the files written, agree(value, op) is one int agreed by every rank."""
    optimizer = engine.optimizer
    pieces = []
    in_files = engine.checkpoint_files()   # offload="disk": tensors whose bytes are in files
    linked: dict = {}                      # such a file -> its entry in this shard's "files"

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
            "pieces": [[p["name"], p["lo"], p["hi"]] for p in pieces], "files": list(linked.values())}
    _atomic_write(os.path.join(path, fname + ".json"), json.dumps(desc).encode())

    # every shard is on disk before rank 0 writes the metadata that names them
    agree(1, "min")
    meta_path = os.path.join(path, METADATA)
    problem = None
    if rank == 0:
        try:
            _publish(engine, path, kind, size, sid)
        except CheckpointError as e:
            problem = e
    # nobody returns before the metadata is in place, and every rank learns whether it is
    if agree(int(problem is None), "min") == 0:
        raise problem or CheckpointError(
            f"{path}: rank 0 could not find every rank's shard in this directory: the ranks must save "
            "into one directory they all share (a shared file system), not one per node")
    return meta_path


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
    _atomic_write(os.path.join(path, METADATA), json.dumps(with_digest(meta), indent=1).encode())
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
        with open(os.path.join(path, METADATA), encoding="utf-8", errors="replace") as f:
            published = f.read(64 << 20)
    except OSError:
        published = ""
    for name in mine:
        if name.removesuffix(".json") not in published:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, name))
