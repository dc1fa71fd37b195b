"""Mesh layout and tensor parallelism against the ordinary (dense) GPT with the same weights."""

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.data import CharDataset
from zerolab.zero_r.mesh import Mesh
from zerolab.models import GPT, gpt_config, gpt_loss
from zerolab.zero_r.tensor_parallel import TensorParallelGPT, dense_grad_shard

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)


def mesh_layout(dp, mp):
    m = Mesh(dp=dp, mp=mp)
    # the groups really contain the ranks the layout names: all-reduce each rank's id inside them
    t = torch.tensor([float(m.rank)])
    m.ledger.all_reduce(t, group=m.mp_group)
    u = torch.tensor([float(m.rank)])
    m.ledger.all_reduce(u, group=m.dp_group)
    return {"dp_rank": m.dp_rank, "mp_rank": m.mp_rank, "mp_ranks": m.mp_ranks, "dp_ranks": m.dp_ranks,
            "mp_sum": t.item(), "dp_sum": u.item()}


def test_mesh_layout_dp2_mp2():
    out = zl.launch(mesh_layout, 4, args=(2, 2))
    assert [o["mp_ranks"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["dp_ranks"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [(o["dp_rank"], o["mp_rank"]) for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # sums computed by hand from the layout: mp groups {0,1} and {2,3}, dp groups {0,2} and {1,3}
    assert [o["mp_sum"] for o in out] == [1, 1, 5, 5]
    assert [o["dp_sum"] for o in out] == [2, 4, 2, 4]


def mesh_errors():
    msgs = []
    for kwargs in (dict(mp=3), dict(dp=3, mp=2), dict(mp=0)):
        try:
            Mesh(**kwargs)
        except ValueError as e:
            msgs.append(str(e))
    cfg = gpt_config("nano")            # n_head = 2
    try:
        TensorParallelGPT(cfg, Mesh(mp=4))
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_mesh_and_tp_bad_input():
    msgs = zl.launch(mesh_errors, 4)[0]
    assert "mp=3 does not divide the world size 4" in msgs[0]
    assert "dp x mp must equal the world size" in msgs[1]
    assert "mp must be an int >= 1" in msgs[2]
    assert "number of attention heads (2) is not divisible by mp=4" in msgs[3]


def tp_vs_dense(mp, tie):
    cfg = gpt_config("nano", n_head=4, tie_weights=tie)
    torch.manual_seed(0)
    dense = GPT(cfg)                     # the same dense model on every rank
    mesh = Mesh(mp=mp)
    tp = TensorParallelGPT.from_dense(dense, mesh)
    batch = CharDataset(cfg.block_size).batch(0, 3)
    dense_logits, dense_loss = gpt_loss(dense, batch)
    dense_loss.backward()
    tp_logits, tp_loss = gpt_loss(tp, batch)
    tp_loss.backward()
    dense_grads = dict(dense.named_parameters())
    worst = 0.0
    for name, p in tp.named_parameters():
        dname = name.replace("proj_bias", "proj.bias")
        expected = dense_grad_shard(dname, dense_grads[dname].grad, cfg, mesh)
        assert p.grad.shape == expected.shape, name
        worst = max(worst, (p.grad - expected).abs().max().item())
    tp_bytes = mesh.ledger.summary()
    return {"logits": (tp_logits - dense_logits).abs().max().item(), "loss": abs(tp_loss.item() - dense_loss.item()),
            "grad": worst, "calls": {k: v["calls"] for k, v in tp_bytes.items()},
            "tags": sorted({r.tag for r in mesh.ledger.records}),
            "n_local": sum(p.numel() for p in tp.blocks.parameters()),
            "n_dense": sum(p.numel() for p in dense.blocks.parameters())}


@pytest.mark.parametrize("mp, tie", [(2, False), (4, True)])
def test_tensor_parallel_gpt_equals_dense(mp, tie):
    out = zl.launch(tp_vs_dense, mp, args=(mp, tie))
    cfg = gpt_config("nano", n_head=4)
    for o in out:
        # the tensor-parallel matmuls sum over slices of the hidden size, then all-reduce the slices:
        # another order than the dense matmul, so logits and gradients (values up to ~10) agree to a
        # few ulp (1e-5), the loss to 1e-6; a wrong slice or a missed all-reduce is off by ~1e-1
        assert o["logits"] < 1e-5 and o["loss"] < 1e-6 and o["grad"] < 1e-5, o
        # one all-reduce in forward and one in backward, for attention and for the MLP of each block
        assert o["calls"]["all_reduce"] == 4 * cfg.n_layer
        assert o["tags"] == ["tp_backward", "tp_forward"]
        # each rank keeps 1/mp of the blocks' matrices (LayerNorms and output biases replicated)
        h = cfg.n_embd
        replicated = cfg.n_layer * (4 * h + 2 * h)  # two LayerNorms (weight + bias) and two output biases
        assert o["n_local"] == (o["n_dense"] - replicated) // mp + replicated
