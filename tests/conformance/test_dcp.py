"""Checkpoints that cross engines: FSDP2's torch.distributed.checkpoint directories into zerolab,
and zerolab's into FSDP2, at 2 and 4 ranks and across them.

FSDP2 (fully_shard on the model of cases.py, AdamW, PyTorch's loop) trains six steps and saves the
way PyTorch's recipe does (get_state_dict, then dcp.save({"model": ..., "optim": ...})) and the way
torchtitan does (the model's names at the top level, the optimizer flattened under "optimizer");
then it takes one more step. zl.checkpoint.load reads each directory into zl.ZeRO stages 1 and 3
and zl.DDP: the weights must be FSDP2's (1e-6: they are copied, so in practice exactly), and one
more step with the loaded AdamW state must land where FSDP2's did. The other way, zl.ZeRO stages 1
and 3 save with format="dcp" and FSDP2 loads with get_state_dict / dcp.load / set_state_dict, as its
users do, and steps on. The run at 4 ranks also reads the directories the run at 2 wrote.

And a whole-matrix optimizer (Muon beside AdamW, zl.CombinedOptimizer) saved as DCP by ZeRO-3 and
resumed by ZeRO-1 continues as the uninterrupted run; zerolab's own format refuses it by name.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zerolab as zl

from cases import STEPS, TOL, engine_for, model, pytorch_loop, weights, worst

pytestmark = pytest.mark.slow     # launches ranks (make test-fast leaves it out)

ADAMW = dict(lr=1e-2)
FRESH = dict(lr=1e-3)             # what a loading script builds: the checkpoint's groups restore lr=1e-2
NEXT = range(STEPS, STEPS + 1)    # the step after the checkpoint
ENGINES = ("zero1", "zero3", "ddp")


def full(net) -> dict:
    """FSDP2's weights, gathered (full_tensor), fp32 on the CPU."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
            for k, v in net.state_dict().items()}


def fsdp2_model(hyper=ADAMW):
    net = model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name in ("embed", "branch", "out"):
        fully_shard(getattr(net, name), mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), **hyper)


def fsdp2_saves(root):
    net, opt = fsdp2_model()
    pytorch_loop(net, opt)
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "recipe"))
    flat = get_optimizer_state_dict(net, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**model_sd, "optimizer": flat}, checkpoint_id=os.path.join(root, "torchtitan"))
    saved = full(net)
    pytorch_loop(net, opt, steps=NEXT)
    return {"saved": saved, "next": full(net)}


def zerolab_loads(directory, name):
    net = model()
    opt = torch.optim.AdamW(net.parameters(), **FRESH)
    engine = engine_for(name, net, opt)
    zl.checkpoint.load(engine, directory)
    loaded = weights(engine)
    pytorch_loop(engine, opt, steps=NEXT)
    return {"loaded": loaded, "next": weights(engine)}


def zerolab_saves(root, name):
    net = model()
    opt = torch.optim.AdamW(net.parameters(), **ADAMW)
    engine = engine_for(name, net, opt)
    pytorch_loop(engine, opt)
    zl.checkpoint.save(engine, os.path.join(root, name), format="dcp")
    saved = weights(engine)
    pytorch_loop(engine, opt, steps=NEXT)
    return {"saved": saved, "next": weights(engine)}


def fsdp2_loads(directory):
    net, opt = fsdp2_model(FRESH)
    model_sd, optim_sd = get_state_dict(net, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full(net)
    pytorch_loop(net, opt, steps=NEXT)
    return {"loaded": loaded, "next": full(net)}


def muon_and_adamw(engine_or_net):
    named = [(n, p) for n, p in engine_or_net.named_parameters() if p.requires_grad]
    return zl.CombinedOptimizer(torch.optim.Muon([p for _, p in named if p.ndim == 2], lr=0.02),
                                torch.optim.AdamW([p for _, p in named if p.ndim != 2], **ADAMW))


def muon_resumed(root):
    """ZeRO-3 trains with Muon and AdamW, saves as DCP and goes on; ZeRO-1 resumes from the file."""
    net = model()
    opt = muon_and_adamw(net)
    engine = engine_for("zero3", net, opt)
    pytorch_loop(engine, opt)
    try:
        zl.checkpoint.save(engine, os.path.join(root, "own-format"))
        refused = None
    except zl.checkpoint.CheckpointError as e:
        refused = str(e)
    zl.checkpoint.save(engine, os.path.join(root, "muon"), format="dcp", extra={"data_step": STEPS})
    pytorch_loop(engine, opt, steps=NEXT)
    net2 = model()
    opt2 = muon_and_adamw(net2)
    again = engine_for("zero1", net2, opt2)
    extra = zl.checkpoint.load(again, os.path.join(root, "muon"))
    pytorch_loop(again, opt2, steps=NEXT)
    return {"uninterrupted": weights(engine), "resumed": weights(again), "refused": refused,
            "extra": extra, "steps": again.steps}


def crossing(root, earlier):
    """Everything one launch checks (root: this world size's directory; earlier: the other's)."""
    n = dist.get_world_size()
    out = {"fsdp2": fsdp2_saves(root)}
    for layout in ("recipe", "torchtitan"):
        for name in ENGINES:
            out[("load", layout, name)] = zerolab_loads(os.path.join(root, layout), name)
    for name in ("zero1", "zero3"):
        out[("save", name)] = zerolab_saves(root, name)
        out[("fsdp2 loads", name)] = fsdp2_loads(os.path.join(root, name))
    if earlier is not None:          # written at another world size
        out[("earlier", "load")] = zerolab_loads(os.path.join(earlier, "recipe"), "zero3")
        out[("earlier", "fsdp2 loads")] = fsdp2_loads(os.path.join(earlier, "zero1"))
    out["muon"] = muon_resumed(root)
    out["n"] = n
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    two, four = str(root / "N2"), str(root / "N4")
    return {2: zl.launch(crossing, 2, args=(two, None)), 4: zl.launch(crossing, 4, args=(four, two))}


@pytest.mark.parametrize("n", [2, 4])
def test_an_fsdp2_checkpoint_loads_into_zerolab_engines_with_fsdp2s_weights_and_optimizer(runs, n):
    for rank, r in enumerate(runs[n]):
        theirs = r["fsdp2"]
        for layout in ("recipe", "torchtitan"):
            for name in ENGINES:
                mine = r[("load", layout, name)]
                assert worst(mine["loaded"], theirs["saved"]) <= TOL, (layout, name, n, rank)
                assert worst(mine["next"], theirs["next"]) <= TOL, (layout, name, n, rank)
        assert worst(theirs["next"], theirs["saved"]) > 100 * TOL    # (the next step moves: AdamW's state counts)


@pytest.mark.parametrize("n", [2, 4])
def test_a_zerolab_checkpoint_saved_as_dcp_loads_into_fsdp2(runs, n):
    for rank, r in enumerate(runs[n]):
        for name in ("zero1", "zero3"):
            mine, theirs = r[("save", name)], r[("fsdp2 loads", name)]
            assert worst(theirs["loaded"], mine["saved"]) <= TOL, (name, n, rank)
            assert worst(theirs["next"], mine["next"]) <= TOL, (name, n, rank)


def test_checkpoints_cross_world_sizes(runs):
    two = runs[2][0]
    for rank, r in enumerate(runs[4]):
        got = r[("earlier", "load")]          # FSDP2 at 2 ranks -> ZeRO-3 at 4
        assert worst(got["loaded"], two["fsdp2"]["saved"]) <= TOL, rank
        assert worst(got["next"], two["fsdp2"]["next"]) <= TOL, rank
        got = r[("earlier", "fsdp2 loads")]   # ZeRO-1 at 2 ranks -> FSDP2 at 4
        assert worst(got["loaded"], two[("save", "zero1")]["saved"]) <= TOL, rank
        assert worst(got["next"], two[("save", "zero1")]["next"]) <= TOL, rank


@pytest.mark.parametrize("n", [2, 4])
def test_a_whole_matrix_optimizer_resumes_from_dcp_and_is_refused_by_the_own_format(runs, n):
    for rank, r in enumerate(runs[n]):
        m = r["muon"]
        assert worst(m["resumed"], m["uninterrupted"]) <= 1e-5, (n, rank)   # (tests/conformance/test_whole_matrix.py)
        assert m["refused"] is not None and "format='dcp'" in m["refused"], m["refused"]
        assert m["extra"] == {"data_step": STEPS} and m["steps"] == STEPS + 1
