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
CPU memory (each tensor is stored whole in the metadata's coordinates, whatever sharding wrote
it), then engine.load_state_dict(weights) keeps this rank's part of each parameter, and
engine.optimizer.load_state_dict(state), given the whole model's state in PyTorch's layout, keeps
this rank's part of each state tensor (engines.param_views: the same door a plain PyTorch
checkpoint comes in by). So an FSDP2 checkpoint of any world size loads into any zerolab engine
at any world size.

zl.checkpoint.save(engine, dir, format="dcp") writes one: the consolidated weights
(engine.full_state_dict()) and the optimizer's whole state (optimizer.state_dict(), positions
turned into parameter names, as get_state_dict names them) under "model" and "optim", the
engine's step count and loss scale under "zerolab". Both are collectives through the engine's
ledger; rank 0 then writes the directory alone (DCP with no_dist: no collective outside the
ledger), and every rank waits for it. FSDP2 loads it with its own code:

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
import warnings

import torch

DCP_METADATA = ".metadata"
MODEL_KEY, OPTIM_KEY, OWN_KEY = "model", "optim", "zerolab"


def is_dcp(path) -> bool:
    """Is `path` a torch.distributed.checkpoint directory?"""
    try:
        return os.path.isfile(os.path.join(os.fspath(path), DCP_METADATA))
    except TypeError:
        return False                # (not a path: zerolab's own checks name it)


def _check_engine(engine, action: str) -> None:
    from ..engines.base import Engine
    if not isinstance(engine, Engine):
        raise TypeError(f"zl.checkpoint.{action}: engine must be a zerolab engine (SingleProcess, DDP, "
                        f"NaiveDDP, ZeRO), got {type(engine).__name__}")


def check_own_format(engine, action: str) -> None:
    """zerolab's own format keeps each piece's optimizer state element by element; Muon's and
    Adafactor's state of a matrix is whole, on the rank that steps it (engines.whole_matrix), and
    Adafactor's is not per element at all. Refused, naming the format that holds it."""
    from ..engines.whole_matrix import whole_ids
    from .files import CheckpointError
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


def save(engine, path, extra: dict | None = None, format: str = "dcp") -> str:
    """Write `engine` as a torch.distributed.checkpoint directory (module docstring); returns the
    path of its metadata. Every rank of the engine calls it."""
    import torch.distributed.checkpoint as dist_cp
    if format != "dcp":
        raise ValueError(f"zl.checkpoint.save: format must be 'zerolab' (the default) or 'dcp' "
                         f"(torch.distributed.checkpoint, which FSDP2 loads), got {format!r}")
    _check_engine(engine, "save")
    weights = engine.full_state_dict()                 # (collectives: every rank takes part)
    buf = io.BytesIO()
    torch.save(extra or {}, buf)                       # (read back with weights_only=True)
    state = {MODEL_KEY: weights, OWN_KEY: {"steps": int(engine.steps), "precision": engine.precision.state_dict(),
                                           "extra": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}}
    if engine.optimizer is not None:
        state[OPTIM_KEY] = _by_name(engine.optimizer.state_dict(), _position_names(engine))
    replicas = getattr(engine, "world_size", 1) == 1 and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if replicas else getattr(engine, "rank", 0)
    if rank == 0:                                      # (SingleProcess under launch: rank 0 speaks for all)
        os.makedirs(path, exist_ok=True)
        with _alone():
            dist_cp.save(state, storage_writer=dist_cp.FileSystemWriter(os.fspath(path)), no_dist=True)
    if getattr(engine, "world_size", 1) > 1:
        engine.comm.barrier()                          # (nobody returns before the files exist)
    return os.path.join(os.fspath(path), DCP_METADATA)


# ------------------------------------------------------------------ reading


def _read_all(path) -> dict:
    """Every entry of the checkpoint, by its flattened key, read on this rank alone. Entries that
    are not tensors (param_groups, step counts as numbers) are unpickled with weights_only=True:
    reading a checkpoint never runs code from it."""
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class WeightsOnly(dist_cp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    reader = dist_cp.FileSystemReader(os.fspath(path))
    entries = reader.read_metadata().state_dict_metadata
    flat = {k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata)
            else None for k, md in entries.items()}
    with _alone():
        dist_cp.load(flat, storage_reader=reader, planner=WeightsOnly(flatten_state_dict=False), no_dist=True)
    return flat


def _prefix(keys, names, what, path) -> str:
    """The prefix under which every name of `names` is a key (names: non-empty)."""
    first = names[0]
    candidates = sorted({k[:-len(first)] for k in keys if k.endswith(first)
                         and (len(k) == len(first) or k[-len(first) - 1] == ".")}, key=len)
    for p in candidates:
        if all(p + n in keys for n in names):
            return p
    missing = [n for n in names if not any(k.endswith(n) for k in keys)][:3]
    raise ValueError(f"zl.checkpoint.load: {path} is a torch.distributed.checkpoint directory, but "
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


def load(engine, path) -> dict:
    """Read a torch.distributed.checkpoint directory into `engine` (module docstring); returns the
    `extra` dict a zerolab save stored ({} otherwise). Every rank of the engine calls it."""
    _check_engine(engine, "load")
    flat = _read_all(path)
    mine = list(engine.model.state_dict(keep_vars=True))
    first = {}                                          # tied weights: each alias from its first name
    for n, p in engine.model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), n)
    aliases = {n: first[id(p)] for n, p in engine.model.named_parameters(remove_duplicate=False)}
    stored = [n for n in mine if aliases.get(n, n) == n]
    prefix = _prefix(set(flat), stored, "parameter and buffer", path)
    weights = {n: flat[prefix + aliases.get(n, n)] for n in mine}
    if engine.optimizer is None and any(".state." in k or k.startswith("state.") for k in flat):
        raise ValueError(
            f"zl.checkpoint.load: {path} holds optimizer state, and the engine has no optimizer yet "
            "(built without one: FSDP2's order adopts it at its first step). Build the engine with "
            "the optimizer (zl.ZeRO(model, optimizer, stage=k)) and load then.")
    optimizer = _optimizer_state(flat, engine, path) if engine.optimizer is not None else None
    engine.load_state_dict(weights)
    if optimizer is not None:
        engine.optimizer.load_state_dict(optimizer)
    if f"{OWN_KEY}.steps" not in flat:
        return {}                                       # (FSDP2's, torchtitan's: nothing of ours)
    engine.steps = int(flat[f"{OWN_KEY}.steps"])
    precision = flat.get(f"{OWN_KEY}.precision")
    if isinstance(precision, dict) and precision.get("precision") == engine.precision.name:
        engine.precision.load_state_dict(precision)     # (the loss scale, in fp16)
    extra = flat.get(f"{OWN_KEY}.extra")
    return torch.load(io.BytesIO(extra.numpy().tobytes()), weights_only=True) if extra is not None else {}
