"""Lab 8: ZeRO-3 as passes over a captured step: the shard pass and the prefetch pass (chapter 16).

The student writes two functions over a step captured by zerolab.compiled.capture:

    shard(step, world)       each parameter read as this rank's shard: an all-gather before the
                             first reader in each region (forward, backward), a free after the last
    prefetch(step, depth)    each all-gather's start moved `depth` operations earlier

The library's reduce pass runs between them. The grader checks the rewritten graph the moment each
pass returns (the protocol: a Stop names the node), then trains it on real ranks against eager
zl.ZeRO(stage=3), bit for bit, and holds the liveness pass's prediction to the measured peak.
"""

from __future__ import annotations

import warnings

import torch

import zerolab as zl

from ..compiled import collectives, runs
from ..compiled.capture import capture, gpt_loss
from ..compiled.liveness import liveness
from ..compiled.nodes import is_compute, positions, views_of
from ..compiled.prefetch import prefetch as library_prefetch
from ..compiled.reduce import reduce
from ..compiled.shard import shard as library_shard
from ..compiled.zero import Trainer, zero_step
from .checks import fmt_bytes
from .lab import Check, Lab, Stop, Wrong

SHARD = "the shard pass: each weight gathered before its first reader and freed after its last, per region"
PREFETCH = "the prefetch pass: each all-gather starts `depth` operations early, after what it reads"
DEPTHS = (0, 1, 3)
STEPS = 2
SECTION_PASSES = 'chapter 16, "ZeRO as passes"'


def _node(node, pos) -> str:
    return f"{node.name} (node {pos[node]})"


def _full(param):
    return param.meta.get("full", param.meta["val"])


def _weight_copies(start):
    """The wait of a gather and every view of its result (the gathered weight under its names)."""
    wait = next(u for u in start.users if u.target is collectives.wait)
    return wait, views_of(wait)


def check_shard(step, world: int) -> None:
    """Raise Stop at the first gathered weight the shard pass left wrong."""
    pos = positions(step.graph)
    loss_at = pos[step.loss_node()]
    for param in step.params():
        direct = [u for u in param.users if u.target is not collectives.all_gather_start]
        if direct:
            raise Stop(SHARD, "reads_shard",
                       f"{_node(direct[0], pos)} reads {param.name} itself, which now holds only this rank's "
                       f"part of it ({_full(param).numel() // world} of its {_full(param).numel()} elements), "
                       "not the gathered weight.", "replace the parameter by the gathered weight in EVERY reader "
                       "of the region: user.replace_input_with(param, weight) for each.")
        for start in [u for u in param.users if u.target is collectives.all_gather_start]:
            wait, copies = _weight_copies(start)
            readers = [u for v in copies for u in v.users if u not in copies and u.target is not collectives.free]
            early = [r for r in readers if pos[r] < pos[wait]]
            if early:
                raise Stop(SHARD, "gather_after_first_use",
                           f"{param.name}'s all-gather completes at {_node(wait, pos)}, after "
                           f"{_node(early[0], pos)}, which reads the gathered weight: that reader would run "
                           "before its input exists.", "insert the gather before the FIRST reader of the region: "
                           "min(region, key=pos.__getitem__).")
            frees = [u for v in copies for u in v.users if u.target is collectives.free]
            if not frees:
                raise Stop(SHARD, "not_freed",
                           f"{param.name}'s gathered weight (from {_node(wait, pos)}) is never freed: each rank "
                           "would keep every full weight, ZeRO-1's memory.",
                           "after the region's last reader, free_after(step, weight, last_reader).")
            late = [r for r in readers if pos[r] > pos[frees[0]]]
            if late:
                raise Stop(SHARD, "free_before_last_use",
                           f"{param.name}'s gathered weight is freed at {_node(frees[0], pos)}, before "
                           f"{_node(late[-1], pos)} reads it: a freed weight has 0 bytes.",
                           "free after the LAST reader of the weight or any view of it: "
                           "last_use(weight, positions(step.graph)).")
            if len({pos[r] > loss_at for r in readers}) == 2:
                raise Stop(SHARD, "kept_across_gap",
                           f"one gathered copy of {param.name} (from {_node(wait, pos)}) is read by the forward "
                           f"and by the backward (last at {_node(max(readers, key=pos.__getitem__), pos)}): the "
                           "full weight lives across the gap between them.", "gather once per region: split "
                           "the readers at the loss node, one gather and one free for each half.")


def _operations(k: int) -> str:
    return f"{k} operation" + ("" if k == 1 else "s")


def computes_between(graph, a, b) -> int:
    pos = positions(graph)
    return sum(is_compute(n) for n in graph.nodes if pos[a] < pos[n] < pos[b])


def room(step) -> dict:
    """Before prefetch: for each gather's start, how many operations it may move up past."""
    pos = positions(step.graph)
    out = {}
    for start in [n for n in step.graph.nodes if n.target is collectives.all_gather_start]:
        top = max((pos[i] for i in start.all_input_nodes if i.op != "placeholder"), default=-1)
        out[start] = sum(is_compute(n) for n in step.graph.nodes if top < pos[n] < pos[start])
    return out


def check_prefetch(step, depth: int, before: dict) -> None:
    pos = positions(step.graph)
    for start, space in before.items():
        param = start.args[0]
        wait, copies = _weight_copies(start)
        above = [i for i in start.all_input_nodes if pos[i] > pos[start]] + ([wait] if pos[wait] < pos[start] else [])
        if above:
            raise Stop(PREFETCH, "prefetch_breaks_dependency",
                       f"the all-gather of {param.name} now starts at {_node(start, pos)}, after "
                       f"{_node(above[0], pos)}, which " + ("waits for it" if above[0] is wait else
                                                           "defines what it sends") + ".",
                       "stop walking up at a placeholder or a node the start reads, and at the top of the "
                       "program (node.op == 'root'): a start never passes what it depends on.")
        readers = [u for v in copies for u in v.users if u not in copies and u.target is not collectives.free]
        first = min(readers, key=pos.__getitem__)
        if computes_between(step.graph, wait, first):
            raise Stop(PREFETCH, "wait_moved",
                       f"the wait of {param.name}'s all-gather is at {_node(wait, pos)}, "
                       f"{_operations(computes_between(step.graph, wait, first))} above its first reader "
                       f"{_node(first, pos)}: the gather is waited for before the work it should hide behind.",
                       "move only the start; the wait stays just before the first reader.")
        seen, want = computes_between(step.graph, start, wait), min(depth, space)
        if seen != want:
            raise Stop(PREFETCH, "prefetch_depth",
                       f"the all-gather of {param.name} starts {_operations(seen)} before its wait; with depth "
                       f"{depth} it should be {want} (it had {space} above it).",
                       "count only operations that compute (is_compute(node)): views, collectives and "
                       "placeholders do not count.")


# ------------------------------------------------------------------ one graded run, on every rank


def build_step(plugin, depth: int, rank: int, world: int):
    step = capture(runs.tiny_gpt(), gpt_loss, runs.batch(0, rank, world))
    plugin["shard"](step, world)
    check_shard(step, world)
    reduce(step, world)
    before = room(step)
    plugin["prefetch"](step, depth)
    check_prefetch(step, depth, before)
    return step.recompile()


def measure(plugin) -> dict:
    rank, world = zl.rank(), zl.world_size()
    steps = {d: build_step(plugin, d, rank, world) for d in DEPTHS}
    data = {"rank": rank, "n": world, "peaks": {}}
    for d, step in steps.items():
        trainer = Trainer(runs.tiny_gpt(), runs.adamw(), gpt_loss, None, 3, zl.comm.Ledger(timeout=None), step=step)
        tokens, targets = runs.batch(0, rank, world)
        with zl.memory.AllocationTracker() as tracker:
            out = step.module(*trainer.inputs(), tokens, targets)
        del out
        library = zero_step(runs.tiny_gpt(), gpt_loss, runs.batch(0, rank, world), 3, world, depth=d)
        data["peaks"][d] = (liveness(step).peak, tracker.peak, liveness(library).peak)
    ledger = zl.comm.Ledger(timeout=None)
    trainer = Trainer(runs.tiny_gpt(), runs.adamw(), gpt_loss, None, 3, ledger, step=steps[1])
    for s in range(STEPS):
        ledger.reset()
        trainer.train_step(*runs.batch(s, rank, world))
        data["bytes"] = {op: row["bytes"] for op, row in ledger.summary().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = runs.train_eager(3, STEPS)["weights"]
    names = [n for n, _ in runs.tiny_gpt().named_parameters()]
    mine = dict(zip(names, trainer.full_parameters()))
    data["difference"] = {n: (mine[n] - eager[n]).abs().max().item() for n in names}
    return data


# ------------------------------------------------------------------ the checks, in the parent


def parity(ranks) -> str:
    for d in ranks:
        wrong = {n: x for n, x in d["difference"].items() if x != 0.0}
        if wrong:
            name, x = max(wrong.items(), key=lambda kv: kv[1])
            raise Wrong("weights", f"after {STEPS} steps rank {d['rank']}'s {name} differs from eager "
                        f"zl.ZeRO(stage=3)'s by up to {x!r} ({len(wrong)} parameters differ); on 2 ranks they "
                        "are equal bit for bit.", "a reader that got the wrong tensor, or a weight freed and "
                        "read again, changes the numbers: check each region's readers.", step=STEPS - 1)
    return f"after {STEPS} steps every weight equals eager zl.ZeRO(stage=3)'s, bit for bit, on every rank"


def memory(ranks) -> str:
    for d in ranks:
        for depth, (predicted, measured, library) in d["peaks"].items():
            if predicted != measured:
                raise Wrong("prediction", f"rank {d['rank']}, prefetch {depth}: the liveness pass predicts "
                            f"{predicted:,} B, the tracker measured {measured:,} B.",
                            "memory the graph does not free where it says: a weight kept by a view.")
            if predicted != library:
                raise Wrong("memory", f"rank {d['rank']}, prefetch {depth}: your graph's peak is {predicted:,} B; "
                            f"ZeRO-3's passes reach {library:,} B.", "gather just before the first reader and "
                            "free just after the last: anything else holds a full weight longer.")
    peaks = ranks[0]["peaks"]
    return "predicted = measured = ZeRO-3's, prefetch " + ", ".join(
        f"{d}: {fmt_bytes(p[0])}" for d, p in peaks.items())


def bytes_per_step(ranks) -> str:
    model = runs.tiny_gpt()
    psi = sum(p.numel() for p in model.parameters())
    backward = sum(m.weight.numel() + (m.bias.numel() if isinstance(m, torch.nn.LayerNorm) else 0)
                   for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm)))
    for d in ranks:
        ring = (d["n"] - 1) / d["n"] * 4
        want = {"all_gather": round(ring * (psi + backward)), "reduce_scatter": round(ring * psi)}
        for op, b in want.items():
            if d["bytes"].get(op, 0) != b:
                raise Wrong("bytes", f"rank {d['rank']} sent {d['bytes'].get(op, 0):,} B by {op} in a step; "
                            f"expected {b:,} B ((N-1)/N x 4 B x {psi + backward if op == 'all_gather' else psi}).",
                            "one all-gather per parameter and region that reads it, no more.", step=STEPS - 1)
    return "all-gathers (Psi + Psi read by the backward) and reduce-scatters Psi, x (N-1)/N x 4 B, every step"


LAB = Lab(
    name="compiled", number=8, title="ZeRO-3 as compiler passes", chapter="chapter 16, ZeRO seen by a compiler",
    stub_file="lab8_compiled.py", world_size=2,
    roles={"shard": None, "prefetch": None},
    reference={"shard": library_shard, "prefetch": library_prefetch}, measure=measure,
    checks=(Check(SHARD, None, SECTION_PASSES, "in each region every reader follows the gather and precedes the free"),
            Check(PREFETCH, None, SECTION_PASSES, "every start moved min(depth, room) operations up, below its inputs"),
            Check("parity with eager zl.ZeRO(stage=3), bit for bit", parity,
                  'chapter 16, "Equal to the eager engines"'),
            Check("memory: predicted peak = measured peak = ZeRO-3's", memory,
                  'chapter 16, "Memory, predicted from the graph"'),
            Check("bytes per step: against the closed form", bytes_per_step,
                  'chapter 16, "Equal to the eager engines"')),
    mistakes_module="zerolab.labs.compiled_mistakes",
    blame={**dict.fromkeys(("reads_shard", "gather_after_first_use", "not_freed", "free_before_last_use",
                            "kept_across_gap", "weights", "bytes", "memory", "prediction"), ("shard",)),
           **dict.fromkeys(("prefetch_breaks_dependency", "wait_moved", "prefetch_depth"), ("prefetch",))},
)
