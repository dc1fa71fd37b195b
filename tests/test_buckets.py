"""The flat bucket layout: views, reverse order, padding, shards (single process, no ranks)."""

import pytest
import torch

from zerolab.buckets import FlatBuckets, bucket_order
from zerolab.optim.param_views import ParamViews
from zerolab.models import AwkwardModel, GPT, gpt_config


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_params_and_grads_become_views_of_padded_buffers(world_size):
    torch.manual_seed(0)
    model = AwkwardModel()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    order = bucket_order(model)
    fb = FlatBuckets(order, bucket_bytes=200, world_size=world_size)
    fb.bind_params()
    fb.bind_grads()
    assert len(fb) > 1
    # the frozen layer is left out; the tied weight appears once
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert [id(p) for p in fb.params] == [id(p) for p in order] and set(map(id, fb.params)) == trainable
    for b in fb.buckets:
        assert b.padded_numel % world_size == 0 and 0 <= b.padded_numel - b.numel < world_size
        base_p, base_g = b.data.data_ptr(), b.grad.data_ptr()
        for p, off in zip(b.params, b.offsets):
            assert p.data_ptr() == base_p + off * p.element_size()
            assert p.grad.data_ptr() == base_g + off * p.grad.element_size()
        # shards tile the padded buffer exactly
        pieces = [b.shard(r) for r in range(world_size)]
        assert pieces[0].start == 0 and pieces[-1].stop == b.padded_numel
        assert all(a.stop == c.start for a, c in zip(pieces, pieces[1:]))
        assert torch.count_nonzero(b.data[b.numel:]) == 0  # padding is zeros
    # values survive the move into the buffers
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_reverse_forward_order_and_accumulation_into_buckets():
    torch.manual_seed(0)
    model = GPT(gpt_config("nano"))
    fb = FlatBuckets(bucket_order(model), bucket_bytes=30_000, world_size=2)
    fb.bind_params()
    fb.bind_grads()
    # the output head is used last in forward, so it is first in bucket 0
    assert fb.buckets[0].params[0] is model.head.weight
    assert fb.buckets[-1].params[-1] is model.tok_emb.weight
    # autograd accumulates into the views, so the flat buffer holds the gradient
    ref = GPT(gpt_config("nano"))
    ref.load_state_dict(model.state_dict())
    x = torch.randint(0, 96, (2, 16))
    for m in (model, ref):
        m(x).float().pow(2).mean().backward()
        m(x).float().pow(2).mean().backward()   # twice: accumulation, not replacement
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        b, i = fb.where[p]
        assert p.grad.data_ptr() == fb.buckets[b].grad_view(i).data_ptr(), n
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    fb.zero_grads()
    assert all(torch.count_nonzero(b.grad) == 0 for b in fb.buckets)


def test_one_parameter_bigger_than_a_bucket_gets_its_own():
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 1000, 10)]
    fb = FlatBuckets(ps, bucket_bytes=100, world_size=4)
    assert [len(b.params) for b in fb.buckets] == [1, 1, 1]
    with pytest.raises(ValueError, match="bucket_bytes"):
        FlatBuckets(ps, bucket_bytes=0, world_size=2)
    with pytest.raises(ValueError, match="no parameters"):
        FlatBuckets([], bucket_bytes=10, world_size=2)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adam-amsgrad-maximize": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, maximize=True),
}


def _sliced_run(make_opt, world_size, steps=4):
    """One optimizer per simulated rank over ParamViews of that rank's slices of flat buckets,
    beside one plain optimizer over the parameters: parameters 1 and 3 have no gradient on the
    even steps (a branch not taken), so per-parameter step counts matter."""
    torch.manual_seed(0)
    shapes = [(3, 5), (7,), (2, 2, 2), (11,), (4, 3)]
    values = [torch.randn(s) for s in shapes]
    ref = [v.clone() for v in values]
    ref_opt = make_opt(ref)
    params = [torch.nn.Parameter(v.clone()) for v in values]
    fb = FlatBuckets(params, bucket_bytes=100, world_size=world_size)
    fb.bind_params()
    assert len(fb) > 1
    ranks = []
    for rank in range(world_size):
        slices = [b.shard(rank) for b in fb.buckets]
        masters = [b.data[s] for b, s in zip(fb.buckets, slices)]
        views = ParamViews(masters, fb.buckets, slices)
        opt = make_opt(params)
        views.place(opt)
        ranks.append((views, opt, slices))
    for step in range(steps):
        unused = {1, 3} if step % 2 == 0 else set()
        grads = [torch.randn(s) for s in shapes]
        for k, (p, g) in enumerate(zip(ref, grads)):
            p.grad = None if k in unused else g
        ref_opt.step()
        flat_grads = [torch.zeros(b.padded_numel) for b in fb.buckets]
        for k, (p, g) in enumerate(zip(params, grads)):
            b, i = fb.where[p]
            fb.buckets[b].views(flat_grads[b])[i].copy_(g)      # (zeros would move a flat tensor)
        for views, opt, slices in ranks:
            for m, g, s in zip(views.masters, flat_grads, slices):
                m.grad = g[s]
            views.point_grads({id(params[k]) for k in unused})
            opt.step()
            views.drop_grads()
    return ref, ref_opt, params, values, ranks


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("world_size", [1, 3])
def test_an_optimizer_on_per_parameter_views_of_flat_slices_equals_a_plain_one(name, world_size):
    """The views DDP and ZeRO hand the optimizer, on every rank's slices (cut through parameters
    at world 3), against a plain optimizer over the parameters, a parameter without a gradient on
    some steps included: values and per-parameter state agree."""
    ref, ref_opt, params, values, ranks = _sliced_run(OPTIMIZERS[name], world_size)
    for k, (p, want) in enumerate(zip(params, ref)):
        # the same elementwise arithmetic; torch may vectorise a slice's ops differently from the
        # whole tensor's (a few ulp at most)
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
        assert not torch.equal(want, values[k])          # (it trained)
    # the step count of the parameter that sat out two of four steps is its own on every rank
    sat_out = [opt.state[views.view_of[id(params[1])]] for views, opt, _ in ranks
               if views.view_of[id(params[1])].numel()]
    assert sat_out and all(float(st.get("step", 2)) == 2.0 for st in sat_out)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_pieces_of_every_rank_make_the_plain_state_dict_and_load_back(name):
    """consolidate's two halves (pieces on each rank, assemble from all of them) give the plain
    optimizer's state dict; shard() cuts it back into each rank's pieces, and a second run from
    there equals the plain optimizer's continuation."""
    ref, ref_opt, params, values, ranks = _sliced_run(OPTIMIZERS[name], world_size=3)
    blobs = [views.pieces(opt.state_dict()["state"]) for views, opt, _ in ranks]
    want = ref_opt.state_dict()["state"]
    for views, opt, _ in ranks:
        whole = views.assemble(opt.state_dict()["state"], blobs)
        assert sorted(whole) == sorted(want)
        for k in want:
            assert sorted(whole[k]) == sorted(want[k])
            for key, value in want[k].items():
                torch.testing.assert_close(whole[k][key], value, rtol=1e-6, atol=1e-7)
        # back into this rank's pieces: every per-element tensor cut to its view's shape
        mine = views.shard(whole, ref_opt.state_dict()["param_groups"])
        fresh = OPTIMIZERS[name](params)
        views.place(fresh)
        fresh.load_state_dict({"state": mine, "param_groups": opt.state_dict()["param_groups"]})
        for t, st in opt.state.items():
            for key, value in st.items():
                assert torch.equal(fresh.state[t][key], value)
    wrong = {k: {key: (v[..., :1] if v.dim() else v) for key, v in st.items()} for k, st in want.items()}
    with pytest.raises(ValueError, match="belongs to another model"):
        ranks[0][0].shard(wrong, ref_opt.state_dict()["param_groups"])
