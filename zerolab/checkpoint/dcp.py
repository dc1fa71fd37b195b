"""Checkpoints that cross engines: torch.distributed.checkpoint (DCP) directories, read and written.

FSDP2 and torchtitan save with torch.distributed.checkpoint: a directory holding `.metadata` and
one `__<rank>_<n>.distcp` file per writing rank, each tensor stored by chunks of its GLOBAL shape,
so that any world size can read it back. The state dict saved is the one
torch.distributed.checkpoint.state_dict.get_state_dict names:

    model      {parameter or buffer name: tensor}                       ("model.embed.weight", ...)
    optimizer  {"state": {parameter name: {"exp_avg": ..., "step": ...}},
                "param_groups": [{"lr": ..., "params": [parameter names]}]}

under keys the script chooses: PyTorch's recipe saves {"model": ..., "optim": ...}, its tutorial
one Stateful under "app" ("app.model.*", "app.optim.*"), torchtitan the model's names at the top
level and the optimizer flattened under "optimizer" ("optimizer.state.<name>.exp_avg",
"optimizer.param_groups.<name>.lr"). DCP stores each key flattened by dots, so one reader serves
all of them (`load`): it finds the prefix under which every one of the model's names is stored,
and the one under which "state.<parameter>.<entry>" is, and reads them.

zl.checkpoint.load(engine, dir) on such a directory: every rank reads the whole checkpoint into
CPU memory through zerolab.checkpoint.dcp_reader (never DCP's own reader, which unpickles
.metadata with no allow-list; each tensor is stored whole in the metadata's coordinates, whatever
sharding wrote it), the ranks agree that they were given the same checkpoint and that it fits,
then engine.load_state_dict(weights) keeps this rank's part of each parameter, and
engine.optimizer.load_state_dict(state), given the whole model's state in PyTorch's layout, keeps
this rank's part of each state tensor (optim.param_views: the same door a plain PyTorch
checkpoint comes in by). So an FSDP2 checkpoint of any world size loads into any zerolab engine
at any world size.

zl.checkpoint.save(engine, dir, format="dcp") writes one: the consolidated weights
(engine.full_state_dict()) and the optimizer's whole state (optimizer.state_dict(), positions
turned into parameter names, as get_state_dict names them) under "model" and "optim", the
engine's step count and loss scale under "zerolab". Both are collectives through the engine's
ledger; rank 0 then writes the directory alone (DCP with no_dist: no collective outside the
ledger) into a new sibling, adds MANIFEST (every file's size and SHA-256, the step, sealed), and
puts the sibling in place of `dir` whole (atomic.replace_directory): a save that fails keeps the
previous checkpoint, and every rank hears of it. A directory holding files other than a
checkpoint's, or a checkpoint in zerolab's own format (unless replace=True), is refused before
any collective. FSDP2 loads it with its own code:

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

The price of crossing engines this way is memory: a rank holds the whole model and its optimizer
state on the CPU while it reads or writes. zerolab's own format (zerolab.checkpoint.api) never
does, and checks every file's digest; it stays the format for zerolab to zerolab.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import shutil
import warnings

import torch

from . import unpickle
from .atomic import replace_directory, signals_held, stopping_cleanly, write_atomically
from .dcp_reader import MANIFEST_FORMAT, DcpReader
from .files import (DCP_METADATA, MANIFEST, CheckpointError, check_only_checkpoint_files, check_other_format,
                    encode_metadata, file_digest)
from .ranks import check_same_checkpoint, dist_rank, refuse_together

MODEL_KEY, OPTIM_KEY, OWN_KEY = "model", "optim", "zerolab"


def _check_engine(engine, action: str) -> None:
    from ..engines.base import Engine
    if not isinstance(engine, Engine):
        raise TypeError(f"zl.checkpoint.{action}: engine must be a zerolab engine (SingleProcess, DDP, "
                        f"NaiveDDP, ZeRO), got {type(engine).__name__}")


def check_own_format(engine, action: str) -> None:
    """zerolab's own format keeps each piece's optimizer state element by element; Muon's and
    Adafactor's state of a matrix is whole, on the rank that steps it (optim.whole_matrix), and
    Adafactor's is not per element at all. Refused, naming the format that holds it."""
    from ..optim.whole_matrix import whole_ids
    if getattr(engine, "optimizer", None) is not None and whole_ids(engine.optimizer):
        raise CheckpointError(
            f"zl.checkpoint.{action}: zerolab's format keeps optimizer state element by element, and "
            "a whole-matrix optimizer's (Muon, Adafactor) is kept whole per matrix. Use "
            "zl.checkpoint.save(engine, path, format='dcp') (torch.distributed.checkpoint, in "
            "PyTorch's layout), which zl.checkpoint.load reads back at any world size.")


# ------------------------------------------------------------------ names of the optimizer's positions


def _position_names(engine) -> list:
    """The name of the parameter behind each position of engine.optimizer.state_dict()."""
    names = {id(p): n for n, p in engine.model.named_parameters()}
    views = getattr(engine, "views", None)
    if views is not None and getattr(views, "order", None) is not None:
        return [names[id(p)] for p in views.order]
    param_of = {id(m): p for p, m in zip(engine.params, engine.masters)}
    return [names[id(param_of.get(id(t), t))] for g in engine.optimizer.param_groups for t in g["params"]]


def _by_name(state_dict: dict, names: list) -> dict:
    """A PyTorch optimizer state dict (positions) -> get_state_dict's (parameter names)."""
    state = {names[k]: dict(entries) for k, entries in state_dict["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[k] for k in g["params"]]}
              for g in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------ writing


@contextlib.contextmanager
def _alone():
    """DCP on this rank alone (no_dist=True) warns that it assumes one process: that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _check_target(path: str, replace: bool) -> None:
    """Can a DCP checkpoint replace whatever directory `path` is? (Raises CheckpointError.)"""
    if os.path.islink(path):
        raise CheckpointError(f"{path}: is a symbolic link; a DCP save replaces the directory itself, so it "
                              "saves into a real directory only")
    if not os.path.isdir(path):
        return
    check_other_format(path, "dcp", replace)
    check_only_checkpoint_files(path)


def _write(state: dict, path: str, steps: int, kind: str, world_size: int) -> None:
    """DCP's files and the manifest, written into a new sibling of `path` and put in place whole
    (atomic.replace_directory): until then `path` holds the previous checkpoint, untouched."""
    import torch.distributed.checkpoint as dist_cp
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{secrets.token_hex(6)}"
    with stopping_cleanly():
        try:
            os.mkdir(tmp)
            with _alone():
                dist_cp.save(state, storage_writer=dist_cp.FileSystemWriter(tmp), no_dist=True)
            files = []
            for name in sorted(os.listdir(tmp)):
                size, sha256 = file_digest(os.path.join(tmp, name))
                files.append({"file": name, "bytes": size, "sha256": sha256})
            manifest = {"format": MANIFEST_FORMAT, "steps": steps, "engine": kind, "world_size": world_size,
                        "files": files}
            write_atomically(os.path.join(tmp, MANIFEST), encode_metadata(manifest))
            replace_directory(tmp, path)
        except BaseException:
            with signals_held():
                shutil.rmtree(tmp, ignore_errors=True)
            raise


def _as_checkpoint_error(e: BaseException, path: str) -> CheckpointError:
    """One error type for a failed save: what failed, where; the previous checkpoint stands."""
    if isinstance(e, CheckpointError):
        return e
    failures = getattr(e, "failures", None)        # torch's CheckpointException (a BaseException)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    what = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {str(e)[:200]}"
    where = getattr(e, "filename", None) or path
    try:                       # torch.save on a full disk says "unexpected pos", not ENOSPC
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        full = f"; its file system has {free:,} bytes free" if free < 16 << 20 else ""
    except OSError:
        full = ""
    return CheckpointError(f"{where}: the DCP save failed ({what}){full}; nothing was changed in {path}: "
                           "the previous checkpoint there, if any, stands")


def save(engine, path, extra: dict | None = None, format: str = "dcp", *, replace: bool = False) -> str:
    """Write `engine` as a torch.distributed.checkpoint directory (module docstring); returns the
    path of its metadata. Every rank of the engine calls it."""
    from torch.distributed.checkpoint.api import CheckpointException
    from .writer import check_save_dir
    if format != "dcp":
        raise ValueError(f"zl.checkpoint.save: format must be 'zerolab' (the default) or 'dcp' "
                         f"(torch.distributed.checkpoint, which FSDP2 loads), got {format!r}")
    _check_engine(engine, "save")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"checkpoint.save: extra must be a dict or None, got {type(extra).__name__}")
    path = check_save_dir(path).rstrip(os.sep) or os.sep
    problem = None
    try:                                               # every rank, before any collective
        _check_target(path, replace)
    except CheckpointError as e:
        problem = e
    refuse_together(engine, path, problem, "cannot save there")
    weights = engine.full_state_dict()                 # (collectives: every rank takes part)
    buf = io.BytesIO()
    torch.save(extra or {}, buf)                       # (read back by zerolab.checkpoint.unpickle)
    state = {MODEL_KEY: weights, OWN_KEY: {"steps": int(engine.steps), "precision": engine.precision.state_dict(),
                                           "extra": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}}
    if engine.optimizer is not None:
        state[OPTIM_KEY] = _by_name(engine.optimizer.state_dict(), _position_names(engine))
    problem = None
    if dist_rank(engine) == 0:                         # (rank 0 of the engine's group speaks for all)
        try:
            _write(state, path, int(engine.steps), engine.checkpoint_kind, int(getattr(engine, "world_size", 1)))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must hear of it
            problem = _as_checkpoint_error(e, path)
    refuse_together(engine, path, problem, "could not write the checkpoint")
    return os.path.join(path, DCP_METADATA)


# ------------------------------------------------------------------ reading


def _prefix(keys, names, what, path) -> str:
    """The prefix under which every name of `names` is a key (names: non-empty)."""
    first = names[0]
    candidates = sorted({k[:-len(first)] for k in keys if k.endswith(first)
                         and (len(k) == len(first) or k[-len(first) - 1] == ".")}, key=len)
    for p in candidates:
        if all(p + n in keys for n in names):
            return p
    missing = [n for n in names if not any(k.endswith(n) for k in keys)][:3]
    raise CheckpointError(f"zl.checkpoint.load: {path} is a torch.distributed.checkpoint directory, but "
                     f"not of this model: no prefix holds every {what} name (none has {missing or names[:3]}). "
                     "Load it into the model it was saved from.")


def _optimizer_state(flat, engine, path):
    """engine.optimizer's state dict in PyTorch's layout (positions) from the checkpoint, or None
    when it holds no optimizer state for this model."""
    names = _position_names(engine)
    trained = [n for n in names if n in dict(engine.model.named_parameters())]
    keys = list(flat)
    prefixes = sorted({k[:k.index("state." + n + ".")] for n in trained for k in keys
                       if ("state." + n + ".") in k and (k.index("state." + n + ".") == 0
                                                         or k[k.index("state." + n + ".") - 1] == ".")}, key=len)
    if not prefixes:
        return None
    q = prefixes[0]
    state = {}
    for k, n in enumerate(names):
        head = f"{q}state.{n}."
        entries = {key[len(head):]: value for key, value in flat.items()
                   if key.startswith(head) and "." not in key[len(head):]}
        if entries:
            state[k] = entries
    hyper = _hyperparameters(flat, q)
    groups, at = [], 0
    for g in engine.optimizer.param_groups:
        positions = list(range(at, at + len(g["params"])))
        at += len(g["params"])
        saved = next((hyper(names[k]) for k in positions if hyper(names[k])), {})
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       **{k: v for k, v in saved.items() if k in g and k != "params"}, "params": positions})
    return {"state": state, "param_groups": groups}


def _hyperparameters(flat, q):
    """name -> the hyperparameters of its group in the checkpoint ({} if none are saved). DCP
    stores get_state_dict's list of groups as "param_groups.<i>.<key>" (or whole, as one entry),
    torchtitan's flattened form as "param_groups.<parameter name>.<key>"."""
    head = q + "param_groups"
    listed = flat.get(head) if isinstance(flat.get(head), list) else None
    if listed is None:
        by_index: dict = {}
        for k, v in flat.items():
            index, _, key = k[len(head) + 1:].partition(".")
            if k.startswith(head + ".") and index.isdigit() and key and "." not in key:
                by_index.setdefault(int(index), {})[key] = v
        listed = [by_index[i] for i in sorted(by_index)] or None
    if listed is not None:
        return lambda name: next((g for g in listed if name in g.get("params", ())), {})

    def flattened(name):
        at = f"{head}.{name}."
        return {k[len(at):]: v for k, v in flat.items() if k.startswith(at) and "." not in k[len(at):]}
    return flattened


def _nested(flat: dict, head: str):
    """The value DCP flattened under `head` ("zerolab.precision.scaler.scale" ...), nested again."""
    if head in flat:
        return flat[head]
    out: dict = {}
    for key, value in flat.items():
        if key.startswith(head + "."):
            *parents, leaf = key[len(head) + 1:].split(".")
            at = out
            for p in parents:
                at = at.setdefault(p, {})
            at[leaf] = value
    return out or None


def _plan(engine, flat: dict, path: str) -> dict:
    """What loading `flat` into `engine` will set, every piece checked first (CheckpointError):
    the weights by the model's own keys, the optimizer's state in PyTorch's layout, ours."""
    model = engine.model.state_dict(keep_vars=True)
    first = {}                                          # tied weights: each alias from its first name
    for n, p in engine.model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), n)
    aliases = {n: first[id(p)] for n, p in engine.model.named_parameters(remove_duplicate=False)}
    stored = [n for n in model if aliases.get(n, n) == n]
    prefix = _prefix(set(flat), stored, "parameter and buffer", path)
    weights = {n: flat[prefix + aliases.get(n, n)] for n in model}
    for n, value in weights.items():
        if not (isinstance(value, torch.Tensor) and value.shape == model[n].shape
                and value.is_floating_point() == model[n].is_floating_point()):
            got = f"{list(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(f"{path}: {prefix + aliases.get(n, n)!r} is {got}; the model's {n!r} is "
                                  f"{list(model[n].shape)} {model[n].dtype}")
    if engine.optimizer is None and any(".state." in k or k.startswith("state.") for k in flat):
        raise CheckpointError(
            f"zl.checkpoint.load: {path} holds optimizer state, and the engine has no optimizer yet "
            "(built without one: FSDP2's order adopts it at its first step). Build the engine with "
            "the optimizer (zl.ZeRO(model, optimizer, stage=k)) and load then.")
    optimizer = _optimizer_state(flat, engine, path) if engine.optimizer is not None else None
    for position, entries in (optimizer or {}).get("state", {}).items():
        for k, v in entries.items():
            if not (isinstance(v, torch.Tensor) or isinstance(v, (int, float, bool)) or v is None):
                raise CheckpointError(f"{path}: optimizer state {k!r} of position {position} is a "
                                      f"{type(v).__name__}, not a tensor or a number")
    plan = {"weights": weights, "optimizer": optimizer, "steps": None, "precision": None, "extra": {}}
    if f"{OWN_KEY}.steps" in flat:                      # (FSDP2's, torchtitan's: nothing of ours)
        steps, extra = flat[f"{OWN_KEY}.steps"], flat.get(f"{OWN_KEY}.extra")
        if not (isinstance(steps, int) and steps >= 0 and (extra is None or isinstance(extra, torch.Tensor)
                                                              and extra.dtype == torch.uint8 and extra.dim() == 1)):
            raise CheckpointError(f"{path}: {OWN_KEY}.steps or {OWN_KEY}.extra is not what zerolab writes")
        plan["steps"] = steps
        plan["precision"] = _nested(flat, f"{OWN_KEY}.precision")
        if extra is not None:
            plan["extra"] = unpickle.torch_archive(extra.numpy().tobytes(), f"{path} ({OWN_KEY}.extra)")
            if not isinstance(plan["extra"], dict):
                raise CheckpointError(f"{path}: {OWN_KEY}.extra is a {type(plan['extra']).__name__}, not a dict")
    return plan


def load(engine, path) -> dict:
    """Read a torch.distributed.checkpoint directory into `engine` (module docstring); returns the
    `extra` dict a zerolab save stored ({} otherwise). Every rank of the engine calls it, with the
    same checkpoint: the ranks compare it first (its manifest's digest, or its .metadata's), and
    a checkpoint any rank refuses changes no rank."""
    _check_engine(engine, "load")
    try:
        reader, problem = DcpReader(path, say_unverified=dist_rank(engine) == 0), None
    except CheckpointError as e:
        reader, problem = None, e
    check_same_checkpoint(engine, path, None if reader is None else reader.seen, problem)
    if problem is not None:
        raise problem
    try:
        plan = _plan(engine, reader.read_all(), os.fspath(path))
    except CheckpointError as e:
        plan, problem = None, e
    refuse_together(engine, path, problem)
    try:
        engine.load_state_dict(plan["weights"])
        if plan["optimizer"] is not None:
            engine.optimizer.load_state_dict(plan["optimizer"])
        precision = plan["precision"]
        if isinstance(precision, dict) and precision.get("precision") == engine.precision.name:
            engine.precision.load_state_dict(precision)     # (the loss scale, in fp16)
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{path}: the engine refused what the checkpoint holds "
                              f"({type(e).__name__}: {str(e)[:300]})") from None
    if plan["steps"] is not None:
        engine.steps = plan["steps"]
    return plan["extra"]


def consolidate(path) -> dict:
    """The model's weights in a torch.distributed.checkpoint directory, as one state dict (fp32
    floating tensors): those under "model." (zerolab's and PyTorch's recipe's layout)."""
    flat = DcpReader(path, say_unverified=True).read_all()
    head = MODEL_KEY + "."
    model = {k[len(head):]: v for k, v in flat.items() if k.startswith(head) and isinstance(v, torch.Tensor)}
    if not model:
        raise CheckpointError(
            f"{path}: a torch.distributed.checkpoint directory with nothing under 'model.' (torchtitan keeps "
            "the model's weights at the top level, among the optimizer's): which entries are the model "
            "cannot be told without it. Load it into the model with zl.checkpoint.load(engine, path), which "
            "finds them by the model's own names, then take engine.full_state_dict()")
    return {k: v.float() if v.is_floating_point() else v for k, v in model.items()}
