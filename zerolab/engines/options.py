"""Every option of every engine, checked once, in one place per family.

    engine = zl.ZeRO(model, optimizer, stage=3, precision="bf16", prefetch=1, quantize_weights=True)

The engines take their options as keywords (the names below are the public API). Each keyword
belongs to one family, a small frozen dataclass that checks its own values:

    Training   precision, scaler, max_grad_norm, track_peak, track_activations, broadcast_buffers,
               bitwise
    Layout     bucket_mb, overlap (DDP, ZeRO-1/2), prefetch, units, init_fn (ZeRO-3)
    Residual   mesh, checkpoint_activations, partition_activations, offload_activations (ZeRO-R, chapter 9)
    ZeroPP     topology, quantize_weights, secondary_partition, quantize_gradients, shard_group (chapter 12)
    Offload    offload, offload_dir, delay_update (chapter 13)

EngineOptions.parse(engine, keywords) refuses a keyword the engine does not take, builds the five
families, runs the checks across them, and returns the one object the engine reads its settings
from (engine.options). None of these checks needs another rank, so a bad value fails before any
collective could hang. The checks that need the model are check_model's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

import torch

from ..precision import check_precision


def _flag(name, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_max_grad_norm(max_grad_norm) -> None:
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not
                                      isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be None or a number > 0; got {max_grad_norm!r}")


@dataclass(frozen=True)
class Training:
    """How every step computes: the precision (and fp16's loss scaler), clipping, what is measured."""

    precision: str = "fp32"
    scaler: object = None               # fp16: a zl.precision.LossScaler (None: the default one; False: none)
    max_grad_norm: float | None = None  # clip the whole gradient's norm at every step
    track_peak: bool = False            # measure each step's peak memory: a dispatch mode sees every
    #   operation of the step, which costs milliseconds per step on a CPU (memory_report()'s peak)
    track_activations: bool | None = None   # measure what each forward leaves (None: with ZeRO-R)
    broadcast_buffers: bool = True      # rank 0's buffers at the forward after a training forward
    bitwise: bool = False               # the same weights, bit for bit, at any world size (below)

    def __post_init__(self):
        check_precision(self.precision)
        check_max_grad_norm(self.max_grad_norm)
        _flag("bitwise", self.bitwise)
        if self.bitwise and self.precision == "fp16":
            raise ValueError("bitwise=True with precision='fp16' is not supported: the loss scale skips "
                             "steps by overflow and rescales the gradients. Use 'fp32' or 'bf16' (bf16 "
                             "compute with fp32 masters).")
        if self.track_activations is not None and not isinstance(self.track_activations, bool):
            raise TypeError(f"track_activations must be None (automatic), True or False, got "
                            f"{self.track_activations!r}")


BITWISE = """bitwise=True: the same weights and optimizer state, bit for bit (torch.equal), on 1, 2, 4
or 8 ranks and on every engine that takes it (zl.SingleProcess, zl.DDP, zl.ZeRO(stage=1 | 2 | 3)),
on one machine, torch and kernel set (zerolab.bitwise says why each order is fixed).

The contract:
* each backward is one CHUNK of the global batch (a micro-batch), and the backwards a rank runs
  between two steps are its chunks in order: rank r's k-th backward is global chunk r*K + k (K
  backwards per step on every rank, the same K on every rank, a power of two; N a power of two;
  C = N*K chunks, the same C at every N). This is gradient accumulation as nanoGPT writes it:
  grad_accum_steps //= world_size, loss = chunk_mean_loss / grad_accum_steps, and the data gives
  rank r its contiguous rows. The engine divides the sum by N, so the step's gradient is
  (1/C) * the fixed-tree sum of the chunks' mean gradients (K and N powers of two: exact);
* nothing is reduced during backward: as each backward ends, each bucket's gradient (ZeRO-3:
  each unit's) is cast to fp32 and added into its tree (zerolab.bitwise.buckets.ChunkTrees), and
  p.grad is freed for the next chunk; between backward and step p.grad holds a placeholder that
  refuses to be read (engines.chunk_grad), and the overlap= option has nothing to overlap;
  no_sync() and require_backward_grad_sync are accepted and change nothing (but see zl.DDP
  with no optimizer, below);
* at the step (or at engine.clip_grad_norm_, whichever comes first) the ranks agree on K (one
  small all-reduce: unequal or not a power of two is refused by name on every rank), then each
  tree goes up the fixed tree across ranks (DDP: tree_all_reduce; ZeRO: tree_reduce_scatter into
  this rank's shard), divided by N. So in this mode ZeRO-2 and ZeRO-3 hold full gradients
  between backward and step, as DDP does (parameters and optimizer state stay sharded);
* zl.DDP(model, bitwise=True) with no optimizer, beside the script's own (torch's SGD/AdamW
  with foreach=False, or zl.ShardedOptimizer(..., bitwise=True)), as with torch's DDP: the
  synced backward (require_backward_grad_sync, outside no_sync) ends the step's chunks and
  writes the tree's average into p.grad; the script zeroes it after each step (refused if not);
* clipping (max_grad_norm=, engine.clip_grad_norm_) takes the exact squared norm
  (zerolab.bitwise.norm: integer sums, so no layout, bucket or shard can change a bit) and
  min(1, max_norm / (norm + 1e-6)) (zerolab.bitwise.norm.clip_coefficient); torch's own
  clip_grad_norm_(model.parameters()) is refused by p.grad's placeholders, by name;
* the optimizer: SGD, Adam or AdamW (elementwise updates), stepped with torch's single-tensor
  kernels on every engine (its groups' foreach is set to False; foreach=True or fused=True is
  refused), so a parameter, a view of a flat buffer or a shard's piece gets the same arithmetic;
  buckets are padded to a multiple of N * 256 elements, so every shard starts on the same
  alignment;
* precision 'fp32', or 'bf16' (bf16 compute, fp32 masters and fp32 sums); fp16 is refused;
* refused by name too: a world size that is not a power of two, ranks with different numbers of
  intra-op threads, NaiveDDP, offload, a mesh (tensor parallelism), ZeRO++ and HSDP options.
The default mode (bitwise=False) is untouched: the ring, overlapped, its bytes as they were."""


@dataclass(frozen=True)
class Layout:
    """How the parameters are laid out and moved: buckets (DDP, ZeRO-1/2) or units (ZeRO-3)."""

    bucket_mb: float = 25.0             # megabytes per flat bucket (ZeRO-3: checked, unused)
    overlap: bool | None = None         # launch each bucket as it fills (None: the engine's default)
    prefetch: int = 1                   # ZeRO-3: units gathered ahead of need
    units: object = None                # ZeRO-3: the submodules gathered and freed as one
    init_fn: object = None              # ZeRO-3: init_fn(name, module) for a meta-device model

    def __post_init__(self):
        b = self.bucket_mb
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0 or not math.isfinite(b):
            raise ValueError(f"bucket_mb must be a number > 0 (megabytes per bucket), got {b!r}")
        p = self.prefetch
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"prefetch must be an int >= 0 (units to gather ahead; 0 = off), got {p!r}")


@dataclass(frozen=True)
class Residual:
    """ZeRO-R (chapter 9): a model-parallel mesh and what activation checkpoints keep."""

    mesh: object = None
    checkpoint_activations: bool = False
    partition_activations: bool = False
    offload_activations: bool = False

    def __post_init__(self):
        from ..zero_r.mesh import Mesh
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a zl.Mesh (or None), got {type(self.mesh).__name__}")
        for f in ("checkpoint_activations", "partition_activations", "offload_activations"):
            _flag(f, getattr(self, f))
        if (self.partition_activations or self.offload_activations) and not self.checkpoint_activations:
            which = "partition_activations" if self.partition_activations else "offload_activations"
            raise ValueError(f"{which}=True acts on activation checkpoints: it needs "
                             "checkpoint_activations=True as well")

    @property
    def model_parallel(self) -> bool:
        return self.mesh is not None and self.mesh.mp > 1


@dataclass(frozen=True)
class ZeroPP:
    """ZeRO++ and hierarchical sharding (chapter 12): how ZeRO-3's units travel."""

    topology: object = None             # a zl.Topology, or ranks per node
    quantize_weights: bool = False      # qwZ: int8 weights in the forward all-gather
    secondary_partition: str | None = None   # hpZ: "node" keeps a node-local shard for backward
    quantize_gradients: bool = False    # qgZ: int4 gradients, reduced node first
    shard_group: str | None = None      # HSDP: "node" shards inside a node, replicas across nodes

    def __post_init__(self):
        _flag("quantize_weights", self.quantize_weights)
        _flag("quantize_gradients", self.quantize_gradients)
        if self.secondary_partition not in (None, "node"):
            raise ValueError(f"secondary_partition must be None or 'node' (hpZ: keep a node-local "
                             f"shard for backward), got {self.secondary_partition!r}")
        if self.shard_group not in (None, "world", "node"):
            raise ValueError(f"shard_group must be None / 'world' (shard over every rank) or 'node' "
                             f"(HSDP: shard inside a node, replicate across nodes), got {self.shard_group!r}")
        if self.shard_group == "node" and (self.quantize_weights or self.secondary_partition
                                           or self.quantize_gradients):
            raise ValueError("shard_group='node' (HSDP) with ZeRO++ options: HSDP already keeps the "
                             "all-gathers inside the node, and its cross-node all-reduce is not "
                             "quantized here. Use either shard_group='node' or the ZeRO++ options.")

    def given(self) -> list:
        """The names of the options set (a topology alone counts: it only makes sense with them)."""
        return [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]


@dataclass(frozen=True)
class Offload:
    """ZeRO-Offload and ZeRO-Infinity (chapter 13): model states in host memory or in files."""

    offload: str | None = None          # "optimizer" (any stage) | "disk" (stage 3)
    offload_dir: str | None = None      # "disk": where each rank keeps its files
    delay_update: bool = False          # "optimizer": the host's step overlaps the next step

    def __post_init__(self):
        if self.offload is None:
            if self.offload_dir is not None or self.delay_update:
                raise ValueError("offload_dir= and delay_update= are options of offload: pass "
                                 "offload='optimizer' (any stage) or offload='disk' (stage 3)")
            return
        if self.offload not in ("optimizer", "disk"):
            raise ValueError(f"offload must be None, 'optimizer' (fp32 masters and optimizer state in "
                             f"host memory) or 'disk' (stage 3: also parameters, in files); got {self.offload!r}")
        if self.offload == "optimizer" and self.offload_dir is not None:
            raise ValueError("offload_dir is for offload='disk'; offload='optimizer' keeps its state in "
                             "host memory. Drop offload_dir, or use offload='disk' with stage=3.")
        if self.offload == "disk" and self.offload_dir is None:
            raise ValueError("offload='disk' needs offload_dir=, a directory on a fast local disk (NVMe) "
                             "where each rank keeps its shards' files")
        _flag("delay_update", self.delay_update)
        if self.delay_update and self.offload != "optimizer":
            raise ValueError("delay_update=True (the delayed parameter update) needs offload='optimizer'")


def disk_needs_stage_3(stage) -> None:
    if stage != 3:
        raise ValueError(f"offload='disk' needs stage=3 (only stage 3 shards the parameters, which "
                         f"it pages to files unit by unit); got stage={stage}. Use offload='optimizer' "
                         "with stages 1 and 2.")


FAMILIES = {"training": Training, "layout": Layout, "residual": Residual, "zeropp": ZeroPP, "offload": Offload}
FAMILY_OF = {f.name: family for family, cls in FAMILIES.items() for f in fields(cls)}

# what each engine takes (SingleProcess: no data parallelism, so no buffers to broadcast either)
SINGLE = ("precision", "scaler", "max_grad_norm", "track_peak", "bitwise", "bucket_mb")
DATA_PARALLEL = tuple(f.name for f in fields(Training)) + tuple(f.name for f in fields(Residual))
BUCKETED = DATA_PARALLEL + ("bucket_mb", "overlap")
# prefetch is ZeRO-3's, accepted so that zl.ZeRO(stage=k) takes the same for every k; ZeRO++ and
# HSDP's are taken to be refused by name ("only stage 3 has"), not as unknown keywords
ZERO_1_2 = BUCKETED + ("prefetch",) + tuple(f.name for f in fields(ZeroPP))
ZERO_3 = DATA_PARALLEL + ("bucket_mb", "prefetch", "units", "init_fn") + tuple(f.name for f in fields(ZeroPP))
OFFLOAD = tuple(f.name for f in fields(Offload))


@dataclass(frozen=True)
class EngineOptions:
    """One engine's options, by family (see the module docstring)."""

    training: Training = field(default_factory=Training)
    layout: Layout = field(default_factory=Layout)
    residual: Residual = field(default_factory=Residual)
    zeropp: ZeroPP = field(default_factory=ZeroPP)
    offload: Offload = field(default_factory=Offload)

    @classmethod
    def parse(cls, engine: str, takes: tuple, keywords: dict, stage: int | None = None) -> "EngineOptions":
        """Check `keywords` for the engine called `engine`, which takes the options `takes`."""
        unknown = [k for k in keywords if k not in takes]
        if not unknown and "bucket_mb" in keywords and takes == SINGLE and not keywords.get("bitwise"):
            raise TypeError(f"{engine} takes bucket_mb only with bitwise=True (one process has no buckets; "
                            "in bitwise mode its gradients are laid out in the data-parallel engines' "
                            "buckets, so that its norm adds in their order)")
        if unknown:
            known = [k for k in unknown if k in FAMILY_OF]
            why = (f"{known[0]!r} is an option of {FAMILY_OF[known[0]]}, which {engine} does not have"
                   if known else f"no engine has an option {unknown[0]!r}")
            raise TypeError(f"{engine} got an unexpected keyword argument {unknown[0]!r}: {why}. Its "
                            f"options are: {', '.join(takes)}.")
        by_family: dict = {name: {} for name in FAMILIES}
        for k, v in keywords.items():
            by_family[FAMILY_OF[k]][k] = v
        options = cls(**{name: FAMILIES[name](**kw) for name, kw in by_family.items()})
        options._check_across(stage)
        return options

    def _check_across(self, stage) -> None:
        t, r, z, o = self.training, self.residual, self.zeropp, self.offload
        if r.model_parallel:
            # the mp ranks hold different shards: these would need the mp group too
            if t.max_grad_norm is not None:
                raise ValueError("max_grad_norm with a mesh of mp > 1 is not supported: the norm "
                                 "would miss the other mp ranks' shards. Use max_grad_norm=None.")
            if t.precision == "fp16":
                raise ValueError("precision='fp16' with a mesh of mp > 1 is not supported: the mp "
                                 "ranks would not agree on overflow skips. Use 'fp32' or 'bf16'.")
        if t.bitwise:
            if z.given():
                raise ValueError(f"bitwise=True with {', '.join(z.given())} is not supported: ZeRO++ "
                                 "quantizes and HSDP reduces within a node first, so neither adds in the "
                                 "fixed tree. Drop those options.")
            if r.mesh is not None:
                raise ValueError("bitwise=True with a mesh is not supported: its ranks average over the "
                                 "dp group only, and the tree is laid over the whole world. Drop mesh=.")
            if o.offload is not None:
                raise ValueError(f"bitwise=True with offload={o.offload!r} is not supported: the offloaded "
                                 "update runs apart from the fixed tree. Use offload=None.")
        given = z.given()
        if stage is not None and stage != 3 and given:
            raise ValueError(f"{', '.join(given)}: ZeRO++ and HSDP options act on sharded parameters, "
                             f"which only stage 3 has; got stage={stage}. Use stage=3 (or drop the options).")
        if o.offload is not None and given:
            raise ValueError(f"offload with {', '.join(given)}: offloading and ZeRO++ / HSDP are not "
                             "supported together; choose one.")
        if o.offload == "disk" and stage is not None:
            disk_needs_stage_3(stage)

    def check_model(self, model) -> None:
        """The checks that need the model, before it is touched."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        devices = {}
        for name, p in model.named_parameters():
            devices.setdefault(p.device, name)
        if len(devices) > 1:
            where = ", ".join(f"{name!r} on {dev}" for dev, name in devices.items())
            raise ValueError(f"all parameters must be on one device; found {where}. Move the model "
                             "with model.to(zl.device()) before wrapping it.")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("the model has no trainable parameters (every parameter has "
                             "requires_grad=False): there is nothing for data parallelism to train")
        if self.residual.checkpoint_activations and getattr(model, "run_block", None) is not None:
            raise ValueError("activation checkpointing is already enabled on this model (by "
                             "zl.activation_checkpointing.enable or an earlier engine); enable it once: pass the "
                             "options to the engine and not to enable(), or the other way round")

    def settings(self) -> dict:
        """The settings every rank must share, because they decide which collectives run
        (compared across ranks by engines.setup.check_same_model); what only measures or names a
        local place (track_peak, offload_dir, ...) may differ."""
        t, l, r, z, o = self.training, self.layout, self.residual, self.zeropp, self.offload
        return {"precision": t.precision, "bucket_mb": float(l.bucket_mb), "max_grad_norm": t.max_grad_norm,
                "mesh": None if r.mesh is None else (r.mesh.dp, r.mesh.mp),
                "checkpoint_activations": r.checkpoint_activations,
                "partition_activations": r.partition_activations,
                "offload_activations": r.offload_activations, "broadcast_buffers": t.broadcast_buffers,
                "overlap": l.overlap, "prefetch": l.prefetch,
                "zeropp": (z.quantize_weights, z.secondary_partition, z.quantize_gradients, z.shard_group,
                           getattr(z.topology, "ranks_per_node", z.topology)),
                "offload": (o.offload, o.delay_update), **({"bitwise": True} if t.bitwise else {})}

    def replace(self, family: str, **changes) -> "EngineOptions":
        return dataclasses.replace(self, **{family: dataclasses.replace(getattr(self, family), **changes)})
