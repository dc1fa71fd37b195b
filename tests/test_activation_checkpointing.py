"""Activation checkpointing, P_a and P_a+cpu: same training, and the memory and bytes the paper predicts."""

import pytest
import torch

import zerolab as zl

from helpers import B, tp_train
from zerolab import memory
from zerolab.zero_r import activation_checkpointing as checkpointing
from zerolab.data import CharDataset
from zerolab.zero_r.mesh import Mesh
from zerolab.models import GPT, gpt_config, gpt_loss
from zerolab.zero_r.tensor_parallel import TensorParallelGPT

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)



def _held_per_block(make_model, setup, batch):
    """Bytes one more block leaves behind after forward: held(4 blocks) - held(2 blocks) over 2."""
    held = {}
    for layers in (2, 4):
        model = make_model(layers)
        policy = setup(model)
        (_, loss), held[layers] = memory.held_after(gpt_loss, model, batch)
        extra = policy.kept_bytes() if policy is not None and policy.offload else 0
        held[layers] = (held[layers], extra)
        loss.backward()
    return ((held[4][0] - held[2][0]) / 2, (held[4][1] - held[2][1]) / 2)


def test_plain_checkpointing_same_training_with_dropout():
    cfg = gpt_config("nano", dropout=0.1)
    batch = CharDataset(cfg.block_size).batch(0, B)
    results = []
    for use in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        if use:
            checkpointing.enable(model)
        torch.manual_seed(1)   # the dropout masks come from this stream in both runs
        _, loss = gpt_loss(model, batch)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    # recomputation runs the same kernels on the same shapes; only the order in which autograd adds
    # a weight's gradient contributions may differ (round-off, 1e-6); a wrong dropout mask or a
    # missing recomputation moves the loss and gradients by ~1e-2
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    for name, g in results[0][1].items():
        assert torch.allclose(g, results[1][1][name], atol=1e-6), name


def test_checkpointing_keeps_only_block_inputs():
    cfg = gpt_config("nano")
    batch = CharDataset(cfg.block_size).batch(0, B)
    make = lambda layers: GPT(gpt_config("nano", n_layer=layers))
    plain, _ = _held_per_block(make, lambda m: None, batch)
    ckpt, _ = _held_per_block(make, checkpointing.enable, batch)
    block_input = B * cfg.block_size * cfg.n_embd * 4          # closed form: one fp32 (B, T, C) tensor
    assert ckpt == block_input
    assert plain > 10 * block_input, "without checkpointing a block keeps many (B, T, C)-sized tensors"


# ---- dp=2 x mp=2: tensor parallel GPT, data parallel over the dp group by hand


def tp_all_modes():
    return {mode: tp_train(mode) for mode in ("none", "ckpt", "pa", "pa_cpu")}


def test_dp2_mp2_training_is_the_same_in_every_mode():
    out = zl.launch(tp_all_modes, 4)
    for rank, modes in enumerate(out):
        base = modes["none"]
        for mode in ("ckpt", "pa", "pa_cpu"):
            # P_a and P_a+cpu move activations bit for bit and recompute them with the same kernels;
            # 1e-6 leaves room for autograd adding gradient contributions in another order
            assert modes[mode]["losses"] == pytest.approx(base["losses"], abs=1e-6), (rank, mode)
            for name, p in base["params"].items():
                assert torch.allclose(modes[mode]["params"][name], p, atol=1e-6), (rank, mode, name)
        # P_a's extra all-gather per block against the tensor-parallel all-reduces (paper section 8):
        # 6 all-reduces of S per block (2 forward, 2 recompute, 2 backward) at 2(N-1)/N S each,
        # against one all-gather of S at (N-1)/N S: 1/12, "less than 10%".
        pa = modes["pa"]["bytes"]
        ratio = pa["pa_gather"] / (pa["tp_forward"] + pa["tp_backward"])
        assert ratio == pytest.approx(1 / 12, rel=1e-9)


def tp_memory(mp):
    mesh = Mesh(mp=mp)
    batch = CharDataset(32).batch(0, B)

    def make(layers):
        torch.manual_seed(0)
        return TensorParallelGPT.from_dense(GPT(gpt_config("nano", n_head=4, n_layer=layers)), mesh)

    out = {}
    for mode in ("ckpt", "pa", "pa_cpu"):
        setup = lambda m: checkpointing.enable(m, mesh, partition_activations=mode != "ckpt",
                                               offload_activations=mode == "pa_cpu")
        out[mode] = _held_per_block(make, setup, batch)
    return out


@pytest.mark.parametrize("mp", [2, 4])
def test_partitioned_checkpoints_hold_one_mp_th(mp):
    out = zl.launch(tp_memory, mp, args=(mp,))
    cfg = gpt_config("nano")
    block_input = B * cfg.block_size * cfg.n_embd * 4
    for o in out:
        ckpt, _ = o["ckpt"]
        assert ckpt == block_input                     # every mp rank holds the whole input
        pa, _ = o["pa"]
        assert abs(pa - block_input / mp) <= 0.10 * block_input / mp
        held, pool = o["pa_cpu"]
        # on a CPU machine the offload pool is CPU memory too: what stays "on the device" is
        # what is held minus what sits in the pool, and the pool holds the 1/mp slice
        assert held - pool == 0
        assert pool == pytest.approx(block_input / mp, rel=0.10)


def bad_options():
    msgs = []
    model = GPT(gpt_config("nano"))
    for kwargs in (dict(partition_activations=True), dict(offload_activations=True),
                   dict(mesh=Mesh(mp=1), partition_activations=True)):
        try:
            checkpointing.enable(model, **kwargs)
        except ValueError as e:
            msgs.append(str(e))
    checkpointing.enable(model)
    try:
        checkpointing.enable(model)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_bad_options_are_refused_at_construction():
    msgs = zl.launch(bad_options, 2)[0]
    assert "needs a Mesh with mp >= 2 (got no mesh)" in msgs[0]
    assert "needs partition_activations=True" in msgs[1]
    assert "mp >= 2 (got mp=1)" in msgs[2]
    assert "already enabled" in msgs[3]


def test_the_old_module_name_still_imports_and_names_the_new_one():
    import importlib
    import sys
    sys.modules.pop("zerolab.checkpointing", None)
    with pytest.warns(DeprecationWarning, match="zerolab.zero_r.activation_checkpointing"):
        old = importlib.import_module("zerolab.checkpointing")
    assert old.enable is checkpointing.enable
