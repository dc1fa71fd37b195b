"""ZeRO-R on the engines: mesh=, activation checkpointing options, measured activations, C_B.

The reference for training is tests/test_activation_checkpointing.py::tp_train: the same
tensor-parallel GPT trained with a plain torch AdamW whose gradients are averaged over the
dp group by hand. The engines must reach the same losses and parameters (fp32, 1e-6).
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from helpers import B, tp_train
from zerolab.data import CharDataset
from zerolab.memory import model_state_bytes
from zerolab.zero_r.mesh import Mesh
from zerolab.models import GPT, gpt_config, gpt_loss
from zerolab.zero_r.tensor_parallel import TensorParallelGPT

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

STEPS = 3
MODES = {"none": {}, "ckpt": dict(checkpoint_activations=True),
         "pa": dict(checkpoint_activations=True, partition_activations=True),
         "pa_cpu": dict(checkpoint_activations=True, partition_activations=True, offload_activations=True)}


def engine_train(mesh, stage, mode, bucket_mb=0.02):
    """tp_train's run, but the dp averaging and the optimizer are zl.ZeRO's (sharded over dp)."""
    cfg = gpt_config("nano", n_head=4)
    torch.manual_seed(0)
    model = TensorParallelGPT.from_dense(GPT(cfg), mesh)
    eng = zl.ZeRO(model, partial(torch.optim.AdamW, lr=1e-3), stage=stage, mesh=mesh,
                  bucket_mb=bucket_mb, **MODES[mode])
    data = CharDataset(cfg.block_size)
    losses = []
    for step in range(STEPS):
        _, loss = gpt_loss(eng, data.batch(step, B, mesh.dp_rank, mesh.dp))
        eng.backward(loss)
        eng.step()
        if step == STEPS - 1:
            memory = eng.memory_report()   # gradients still held
        eng.zero_grad()
        losses.append(loss.item())
    psi = sum(p.numel() for p in model.parameters())   # this mp rank's shard of the model
    return {"losses": losses, "state": eng.full_state_dict(), "memory": memory, "psi": psi,
            "layout": (eng.world_size, eng.rank, dist.get_process_group_ranks(eng.comm.group))}


def zero_on_mesh():
    ref = tp_train("none", steps=STEPS)
    mesh = Mesh(dp=2, mp=2)
    out = {"ref": {"losses": ref["losses"], "params": ref["params"]}}
    for mode in MODES:
        out[(2, mode)] = engine_train(mesh, 2, mode)
    out[(1, "pa")] = engine_train(mesh, 1, "pa")
    out[(3, "pa")] = engine_train(mesh, 3, "pa")    # ZeRO-3 too: units sharded over dp only
    return out


def test_zero_on_a_dp2_mp2_mesh_trains_like_the_hand_averaged_tensor_parallel_run():
    """Stage 2 with no checkpointing, checkpointing, P_a and P_a+cpu; stages 1 and 3 with P_a."""
    out = zl.launch(zero_on_mesh, 4)
    for rank, runs in enumerate(out):
        ref = runs["ref"]
        dp_rank, mp_rank = divmod(rank, 2)
        for key, run in runs.items():
            if key == "ref":
                continue
            # the engine works over the dp group only
            assert run["layout"] == (2, dp_rank, [mp_rank, 2 + mp_rank]), (rank, key)
            # dp = 2: a sum of two gradients is the same in either order and halving is exact, so
            # the engine and the hand-averaged run agree to round-off of the layout alone (1e-6)
            assert run["losses"] == pytest.approx(ref["losses"], abs=1e-6), (rank, key)
            for name, p in ref["params"].items():
                err = (run["state"][name] - p).abs().max().item()
                assert err <= 1e-6, (rank, key, name, err)

        # model states sharded over dp = 2 (fp32 AdamW: 4 bytes of params, 4 of grads, 8 of
        # moments; the master is the parameter itself), measured vs the formula within 3%
        for stage in (1, 2):
            run = runs[(stage, "pa" if stage == 1 else "none")]
            psi, mem = run["psi"], run["memory"]
            want = model_state_bytes(psi, 2, stage, k=8, param_bytes=4, grad_bytes=4)
            assert abs(mem["total"] - want) <= 0.03 * want, (rank, stage, mem, want)
            assert abs(mem["optimizer"] - 8 * psi / 2) <= 0.03 * 8 * psi / 2

        # memory_report()["activations"]: measured bytes the last forward left for backward
        act = {mode: runs[(2, mode)]["memory"]["activations"] for mode in MODES}
        assert act["ckpt"] < act["none"] / 3, act
        assert act["pa"] < act["ckpt"], act
        # P_a+cpu: same slices as P_a, now in the (CPU) offload pool, so the same bytes on this
        # CPU machine; what matters is that nothing more is held
        assert act["pa_cpu"] <= act["pa"], act


def buffer_bytes(n_layers=(1, 2, 4), bucket_mb=0.05):
    """Stage 2's largest communication-buffer pool over one backward, per model size."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for layers in n_layers:
        cfg = gpt_config("nano", n_layer=layers)
        data = CharDataset(cfg.block_size)
        row = {"psi": None}
        for name, mb in (("bucketed", bucket_mb), ("fused", 1e6)):   # 1e6 MB: one bucket for everything
            torch.manual_seed(0)
            model = GPT(cfg)
            eng = zl.ZeRO(model, partial(torch.optim.AdamW, lr=1e-3), stage=2, bucket_mb=mb,
                          track_peak=False)
            eng.backward(gpt_loss(eng, data.batch(0, 2, rank, n))[1])
            row[name] = eng.max_buffer_bytes
            row["psi"] = sum(p.numel() for p in model.parameters())
        out.append(row)
    return out


def test_stage2_buffers_stay_constant_while_a_fused_buffer_grows_with_the_model():
    rows = zl.launch(buffer_bytes, 2)[0]
    cap = 2 * (0.05 * 2**20 + 2 * 2) * 1.01     # N_BUFFERS buckets of bucket_mb (+ padding)
    psis = [r["psi"] for r in rows]
    assert psis[0] < psis[1] < psis[2]
    for r in rows:
        # "fuse everything": one buffer of the whole padded gradient, 4 bytes per parameter
        assert 4 * r["psi"] <= r["fused"] <= 4 * r["psi"] + 4 * 2, r
        assert r["bucketed"] <= cap, r
    assert rows[0]["bucketed"] == rows[2]["bucketed"], rows   # C_B does not grow with psi


# ---- bad input: refused at construction, before any collective


def test_bad_residual_options_are_refused_at_construction():
    opt = partial(torch.optim.SGD, lr=0.1)
    model = lambda: GPT(gpt_config("nano"))
    with pytest.raises(ValueError, match="needs checkpoint_activations=True"):
        zl.ZeRO(model(), opt, stage=2, partition_activations=True)
    with pytest.raises(ValueError, match="needs checkpoint_activations=True"):
        zl.DDP(model(), opt, offload_activations=True)
    with pytest.raises(ValueError, match="needs partition_activations=True"):
        zl.ZeRO(model(), opt, stage=1, checkpoint_activations=True, offload_activations=True)
    with pytest.raises(ValueError, match=r"needs a Mesh with mp >= 2 \(got no mesh\)"):
        zl.ZeRO(model(), opt, stage=2, checkpoint_activations=True, partition_activations=True)
    with pytest.raises(ValueError, match=r"mp >= 2 \(got mp=1\)"):
        zl.ZeRO(model(), opt, stage=3, mesh=Mesh(mp=1), checkpoint_activations=True,
                partition_activations=True)
    m = model()
    zl.activation_checkpointing.enable(m)
    with pytest.raises(ValueError, match="already enabled"):
        zl.ZeRO(m, opt, stage=2, checkpoint_activations=True)
    with pytest.raises(TypeError, match="mesh must be a zl.Mesh"):
        zl.DDP(model(), opt, mesh=(2, 2))


def bad_mesh():
    msgs = []
    for make in (lambda: Mesh(mp=3), lambda: Mesh(dp=2, mp=2),
                 lambda: TensorParallelGPT(gpt_config("nano", n_head=1), Mesh(mp=2))):
        try:
            make()
        except ValueError as e:
            msgs.append(str(e))
    mesh = Mesh(mp=2)
    for kwargs in (dict(max_grad_norm=1.0), dict(precision="fp16")):
        try:
            zl.ZeRO(TensorParallelGPT(gpt_config("nano", n_head=4), mesh), partial(torch.optim.SGD, lr=0.1),
                    stage=2, mesh=mesh, **kwargs)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_mesh_is_refused_before_any_rank_can_hang():
    msgs = zl.launch(bad_mesh, 2)[0]
    assert len(msgs) == 5, msgs
    assert "mp=3 does not divide the world size 2" in msgs[0]
    assert "dp x mp must equal the world size" in msgs[1]
    assert "attention heads" in msgs[2]
    assert "max_grad_norm with a mesh of mp > 1" in msgs[3]
    assert "precision='fp16' with a mesh of mp > 1" in msgs[4]


def test_activations_are_measured_only_where_asked():
    opt = partial(torch.optim.SGD, lr=0.1)
    cfg = gpt_config("nano")
    batch = CharDataset(cfg.block_size).batch(0, B)
    held = {}
    for name, kwargs in (("off", {}), ("plain", dict(track_activations=True)),
                         ("ckpt", dict(checkpoint_activations=True))):
        torch.manual_seed(0)
        eng = zl.ZeRO(GPT(cfg), opt, stage=2, **kwargs)
        _, loss = gpt_loss(eng, batch)
        held[name] = eng.memory_report()["activations"]
        eng.backward(loss)
    assert held["off"] is None                       # not measured: no number made up
    # checkpointing keeps the block inputs instead of every intermediate result
    assert held["ckpt"] < held["plain"] / 3, held
    with pytest.raises(TypeError, match="track_activations must be"):
        zl.ZeRO(GPT(cfg), opt, stage=2, track_activations="yes")
