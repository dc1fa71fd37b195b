"""What every data-parallel engine does before it trains, and around each forward.

(The options are checked before this runs, each family in one place: zerolab.engines.options.)

* check_same_model: every rank must wrap the same model (names, shapes, dtypes) in the same
  engine with the same options, compared by a checksum over the engine's ledger, and broadcast_from_rank0: ranks start from rank 0's weights;
* data_parallel_layout: which group the engine averages over (the whole world, or a Mesh's dp
  group when the model is tensor-parallel), enable_residual: ZeRO-R's activation options
  (chapter 9) switched on;
* join_data_parallel: all of the above, in order, for a data-parallel engine's constructor (a
  Group the engine keeps), with the optimizer's own checks (zerolab.optim.checks) before the
  model is touched;
* measured_forward: the forward, with the activations it leaves alive counted on request.
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass

import torch

from ..runtime.comm import Ledger
from ..launch import rank as _rank
from ..launch import world_size as _world_size
from ..memory import AllocationTracker, settled
from ..optim.checks import check_no_optimizer, check_optimizer_factory


# ------------------------------------------------------------------ checks at construction


def _signature(model) -> list:
    """(name, one int per parameter) describing every parameter's name, shape and dtype."""
    rows = []
    for name, p in model.named_parameters():
        text = f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
        rows.append((f"{name} {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"
                     f"{'' if p.requires_grad else ' frozen'}", zlib.crc32(text.encode())))
    return rows


def check_same_model(model, ledger: Ledger, src: int = 0, config: dict | None = None) -> None:
    """Raise on every rank, naming the first setting (`config`: the engine, its precision,
    bucket size, options) or parameter where some rank differs from rank `src`.

    Ranks that disagree on the engine or its options would call different collectives (a hang,
    or gloo aborting on a size mismatch) much later; here they stop before the first one. The
    comparison runs over the ledger's group (the dp group under a Mesh, whose first global rank
    is `src`).
    """
    settings = _setting_rows(config or {})
    compare_rows(settings + _signature(model), ledger, src,
                 lambda i: "engines' settings" if i < len(settings) else "models")


def check_same_plan(plan: dict, ledger: Ledger, src: int = 0) -> None:
    """The same comparison for a training run's plan (steps, batch size, learning rate, ...):
    ranks that plan different step counts would finish apart and leave the others waiting."""
    compare_rows(_setting_rows(plan), ledger, src, lambda i: "training plans")


def _setting_rows(settings: dict) -> list:
    return [(f"{k} = {v!r}", zlib.crc32(f"{k}={v!r}".encode())) for k, v in settings.items()]


def compare_rows(rows: list, ledger: Ledger, src: int, what) -> None:
    """rows: (description, hash) on every rank. Raise on every rank the same error, naming the
    first row i in which some rank differs from rank `src`, as the first such rank and as `src`
    describe it. All ranks take part in the same collectives whatever they find, so a mismatch
    ends the job with an error instead of a hang. what(i) names the kind of thing row i is."""
    length = torch.tensor([len(rows)], dtype=torch.int64)
    ledger.all_reduce(length, op="max", tag="setup")
    n = int(length.item())
    mine = torch.full((n,), -1, dtype=torch.int64)
    mine[:len(rows)] = torch.tensor([h for _, h in rows], dtype=torch.int64)
    ref = mine.clone()
    ledger.broadcast(ref, src=src, tag="setup")
    differs = (mine != ref).nonzero()
    first = torch.tensor([int(differs[0]) if len(differs) else n], dtype=torch.int64)
    ledger.all_reduce(first, op="min", tag="setup")
    i = int(first.item())
    if i == n:
        return
    who = torch.tensor([_rank() if mine[i] != ref[i] else 2**62], dtype=torch.int64)
    ledger.all_reduce(who, op="min", tag="setup")     # the first rank that differs at row i
    who = int(who.item())
    here = rows[i][0] if i < len(rows) else "(nothing)"
    theirs, ours = (described_by(here, r, ledger) for r in (who, src))
    raise ValueError(f"the ranks' {what(i)} differ: #{i} is {theirs} on rank {who}, {ours} on rank "
                     f"{src}. Every rank must build the same model and engine, with the same "
                     "options, and plan the same run.")


def described_by(text: str, src: int, ledger: Ledger) -> str:
    """Rank src's `text`, on every rank (at most 160 bytes)."""
    buf = torch.zeros(160, dtype=torch.uint8)
    raw = text.encode()[:160]
    buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    ledger.broadcast(buf, src=src, tag="setup")
    return bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace")


def broadcast_from_rank0(tensors, ledger: Ledger, src: int = 0, tag: str = "setup") -> None:
    """Copy rank `src`'s values (the group's first rank) into `tensors`, one broadcast per dtype."""
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype, ts in by_dtype.items():
            flat = torch.cat([t.reshape(-1) for t in ts])
            ledger.broadcast(flat, src=src, tag=tag)
            for t, chunk in zip(ts, flat.split([t.numel() for t in ts])):
                t.copy_(chunk.view_as(t))


# ------------------------------------------------------------------ the mesh and ZeRO-R options


def process_group_from_environment() -> None:
    """A script started by torchrun that never called init_process_group: start the process group
    from torchrun's environment, as zl.launch does under torchrun (and deepspeed.init_distributed
    does), rather than let each rank train alone while it divides its gradients by WORLD_SIZE."""
    import os
    import warnings
    import torch.distributed as dist
    if dist.is_initialized() or "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    from ..launch.in_place import start_from_environment
    from ..runtime.watchdog import default_timeout
    start_from_environment(default_timeout())
    warnings.warn(f"zerolab: RANK and WORLD_SIZE are set (torchrun) but torch.distributed had no process "
                  f"group: started it from the environment ({dist.get_backend()}, {dist.get_world_size()} "
                  "ranks). Call torch.distributed.init_process_group() yourself to choose its settings.",
                  stacklevel=6)     # (the script's line that built the engine)


_warned_alone = False


def warn_if_alone(name: str) -> None:
    """A data-parallel engine built where torch.distributed has no process group (a script that
    forgot zl.launch or torchrun) trains as one rank: said once per process, since PyTorch's own
    engines refuse outright and a script that meant N ranks would otherwise never know."""
    import warnings
    import torch.distributed as dist
    global _warned_alone
    if dist.is_initialized() or _warned_alone:
        return
    _warned_alone = True
    import os
    import sys
    package, level, frame = os.path.dirname(os.path.dirname(__file__)), 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1      # (the warning names the script's line)
    warnings.warn(f"zerolab: {name} was built with no process group (torch.distributed is not initialised): it "
                  "trains as one rank. Start ranks with zl.launch(fn, world_size=N) or torchrun.", stacklevel=level)


def data_parallel_layout(mesh):
    """(ledger, dp size, dp rank, source rank of the setup broadcasts) for an engine.

    Without a mesh every launched rank is a data-parallel rank. With one, an engine works
    over mesh.dp_group only: the mp ranks of a tensor-parallel model hold DIFFERENT shards,
    so they must neither be averaged together nor compared with each other.
    """
    if mesh is None:
        process_group_from_environment()
        return Ledger(), _world_size(), _rank(), 0
    return Ledger(group=mesh.dp_group), mesh.dp, mesh.dp_rank, mesh.dp_ranks[0]


def enable_residual(model, mesh, checkpoint_activations, partition_activations, offload_activations):
    """zl.activation_checkpointing.enable with the engine's options; None when checkpointing is off."""
    if not checkpoint_activations:
        return None
    from ..zero_r import activation_checkpointing
    return activation_checkpointing.enable(model, mesh, partition_activations=partition_activations,
                                offload_activations=offload_activations)


# ------------------------------------------------------------------ a data-parallel engine starts


@dataclass
class Group:
    """Where a data-parallel engine trains (join_data_parallel's answer): its ledger over the
    ranks it averages over, their number, this rank's place, the rank every rank starts from,
    the Mesh (ZeRO-R) if any, precision, and ZeRO-R's activation options switched on."""

    comm: Ledger
    world_size: int
    rank: int
    src: int
    mesh: object
    precision: object
    activation_checkpointing: object
    track_activations: bool


def join_data_parallel(engine_class, model, optimizer, options) -> Group:
    """What NaiveDDP, DDP, ZeRO-1/2 and ZeRO-3 do first, in this order: the checks that need the
    model or the optimizer (options are checked already: engines.options), the group to average
    over, precision, ZeRO-R's activation options, and the check that every rank wraps the same
    model with the same settings. The engine keeps what it returns; then it lays out its storage."""
    from ..precision import MixedPrecision
    t, r = options.training, options.residual
    name = engine_class.__name__
    options.check_model(model)
    if optimizer is None and engine_class.takes_no_optimizer:
        check_no_optimizer(name, t.precision, t.max_grad_norm)
    elif optimizer is None and engine_class.awaits_optimizer:
        pass                     # FSDP2's order: the script's optimizer is checked when adopted
    else:                        # (before the model is touched)
        if optimizer is None:
            raise TypeError(f"{name} needs an optimizer: it keeps the optimizer state "
                            "(sharded) and steps it. Pass one built on model.parameters(), or a factory "
                            "such as functools.partial(torch.optim.AdamW, lr=3e-4).")
        check_optimizer_factory(optimizer)
    comm, world_size, rank, src = data_parallel_layout(r.mesh)
    warn_if_alone(name)
    group = Group(
        comm, world_size, rank, src, r.mesh, MixedPrecision(t.precision, scaler=t.scaler, ledger=comm),
        enable_residual(model, r.mesh, r.checkpoint_activations, r.partition_activations,
                        r.offload_activations),
        # measuring activations costs an allocation tracker around every forward: on by default
        # only where ZeRO-R is in use (a mesh or checkpointing); None in the report otherwise
        (r.mesh is not None or r.checkpoint_activations) if t.track_activations is None else t.track_activations)
    check_same_model(model, comm, src, {"engine": name, **options.settings()})
    return group


def compiled_parts(model):
    """(the model, its torch.compile wrapper or None).

    torch.compile(model) returns an OptimizedModule around the model, whose state_dict keys all
    start with "_orig_mod.". An engine keeps the model itself (engine.module, checkpoints and
    state dicts under the model's own keys, loadable compiled or not) and runs the forward
    through the wrapper (ZeRO-3 compiles unit by unit instead: zero3.ZeRO3._compile_units)."""
    # (nothing is compiled if Dynamo was never imported: importing it costs seconds per process)
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        return model._orig_mod, model
    return model, None


def measured_forward(engine, *inputs, **kwargs):
    """The model's forward (through torch.compile's wrapper if the model came compiled); with
    track_activations, also the bytes the forward leaves alive.

    Those bytes (saved tensors, checkpoints, offloaded slices, the output) are what backward
    needs: memory_report()["activations"]. MEASURED with an allocation tracker, never derived.
    """
    forward = engine.model if engine.compiled is None else engine.compiled
    if not engine.track_activations:
        return forward(*inputs, **kwargs)
    with AllocationTracker() as tracker:
        out = forward(*inputs, **kwargs)
    mesh = getattr(engine, "mesh", None)
    # tensor parallelism all-reduces inside forward, and gloo's worker thread may hold the
    # last tensor for a moment after the call returned: let the count settle
    engine.last_activations = settled(tracker, 0.1) if mesh is not None and mesh.mp > 1 else tracker.current
    return out
