"""The failure museum (chapter 15): each exhibit's failure still shows, and its fix holds.

Every failure is reproduced (the plain-PyTorch mechanism or zerolab's refusal), and every fix is
judged against an independent reference: one process on the global batch with PyTorch's own
optimizer (zerolab.book.museum_reference), or a closed form. Two launches of two ranks: one for
the ranks that diverge, one for every other exhibit. The exhibits run the default mode, within
round-off of one process; the two fixes that also run with bitwise=True (the token-weighted loss,
a consolidated ZeRO-2 checkpoint) are torch.equal to one process adding the same chunks in the
same tree, in plain PyTorch.
"""

import math
import os

import pytest
import torch

import zerolab as zl
from zerolab.book import museum, museum_reference as ref
from zerolab.checkpoint import CheckpointError

pytestmark = pytest.mark.slow     # launches ranks (make test-fast leaves it out)

N = 2


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("museum"))
    return zl.launch(museum.run_exhibits, N, args=(root, True), output="none"), root


def test_ranks_that_diverge_are_named_where_they_parted(tmp_path):
    with pytest.raises(zl.LaunchError) as info:
        zl.launch(museum.diverge, N, args=(str(tmp_path),), collective_timeout=60, output="none")
    message = str(info.value)
    assert "CollectiveMismatch" in message and "did not complete within" not in message, message[-1500:]
    parted = museum.parting(message)
    lines = museum.TRAIN_PY.splitlines()
    step_line = next(i + 1 for i, text in enumerate(lines) if "engine.step()" in text)
    backward_line = next(i + 1 for i, text in enumerate(lines) if "engine.backward(" in text)
    # rank 0 finished its step and gathers the new weights; rank 1 is still in its extra micro-batch
    assert parted[0] == ("all_gather 'param0'", f"train.py:{step_line}", "engine.step()")
    assert parted[1] == ("reduce_scatter 'bucket0'", f"train.py:{backward_line}", "engine.backward(loss)")


def test_the_same_divergence_under_torch_ddp_corrupts_silently(seen):
    results, _ = seen
    # every all-reduce found a partner: no error, and the two replicas no longer agree
    assert ref.worst(results[0]["diverge on torch DDP"], results[1]["diverge on torch DDP"]) > 1e-3


def test_lamb_steps_whole_tensors_on_every_stage(seen):
    results, _ = seen
    one = ref.lamb_one_process()
    # the failure: LAMB over flat partitions (DeepSpeed's layout) is not the one-process LAMB
    assert ref.worst(ref.lamb_on_flat_partitions(), one) > 1e-3
    for stage in (1, 2):
        for r in results:
            assert ref.worst(r["lamb"][stage], one) < 1e-6, stage


def test_the_clip_refuses_a_local_norm_and_clips_by_the_global_one(seen):
    results, _ = seen
    norm, weights = ref.clip_one_process(0.1)
    locals_ = [r["clip"]["local"] for r in results]
    for r in results:
        c = r["clip"]
        assert math.isclose(c["torch"], norm, rel_tol=1e-6)   # torch's clip on model.parameters(): the global norm
        assert c["local"] < norm * (1 - 1e-3)                 # the failure: one shard's norm is smaller
        assert math.isclose(c["global"], norm, rel_tol=1e-6)
        assert c["bytes"] == 2 * (N - 1) / N * 4               # one all-reduce of one fp32 number
        assert ref.worst(c["weights"], weights) < 1e-6
    assert math.isclose(math.hypot(*locals_), norm, rel_tol=1e-6)   # the shards' norms add in squares
    # FSDP2 (installed PyTorch): clip_grad_norm_ over DTensor shards returns the global norm; the
    # norm of a rank's local shards is the failure's number
    fsdp2 = [r["clip"]["fsdp2"] for r in results]
    assert all(math.isclose(f["returned"], norm, rel_tol=1e-6) and f["local"] < norm * (1 - 1e-3) for f in fsdp2)
    assert math.isclose(math.hypot(*(f["local"] for f in fsdp2)), norm, rel_tol=1e-6)


def test_token_weighted_loss_matches_one_process_and_the_per_micro_batch_mean_does_not(seen):
    results, _ = seen
    tokens, weights = ref.tokens_one_process()
    for r in results:
        for kind in ("zerolab", "torch DDP"):
            habit, fixed = r["tokens"][(kind, False)], r["tokens"][(kind, True)]
            assert habit["tokens"] == fixed["tokens"] == tokens
            assert ref.worst(habit["weights"], weights) > 1e-3, kind
            assert ref.worst(fixed["weights"], weights) < 1e-6, kind


def test_token_weighted_loss_in_one_process_and_its_refusal():
    ids, labels = ref.token_batch(0, 1)
    logits = ref.tiny_lm()(ids)
    tokens = zl.count_tokens([labels])
    assert tokens == int((labels != -100).sum())
    assert torch.allclose(zl.token_weighted_loss(logits, labels, tokens),
                          torch.nn.functional.cross_entropy(logits.reshape(-1, ref.VOCAB), labels.reshape(-1)))
    with pytest.raises(ValueError, match="count_tokens"):
        zl.token_weighted_loss(logits, labels, 0)


def test_a_gradient_arriving_twice_is_added_not_overwritten(seen):
    results, _ = seen
    one = ref.shared_one_process()
    padded = sum(p.numel() for p in ref.Shared().parameters())     # one bucket; even: no padding
    for r in results:
        t = r["twice"]
        # the failure's cause in plain PyTorch: the shared weight's gradient arrives in two parts
        assert len(t["arrivals"]) == 2 and t["arrivals"][-1] == t["full"]
        assert abs(t["arrivals"][0] - t["full"]) > 1e-3 * t["full"]
        assert ref.worst(t["weights"], one) < 1e-6
        assert t["reduced"] == (N - 1) / N * 4 * padded            # reduced once, whole
        # a part that arrives after its bucket was reduced is refused, with what to do
        assert t["late"].startswith("a second part of the gradient of a parameter of shape (8,)"), t["late"]
        assert "use_reentrant=False" in t["late"]


def test_memory_is_what_the_formula_says_once_its_terms_exist(seen):
    results, _ = seen
    for rank, r in enumerate(results):
        m, seen_ = r["memory"], r["memory"]["seen"]
        psi, padded = m["psi"], m["padded"]
        formula = zl.memory.model_state_bytes(psi, N, 2, k=8, param_bytes=4, grad_bytes=4)
        assert seen_["built"]["total"] == 4 * padded                 # no gradient, no Adam state yet
        assert seen_["after backward"]["grads"] == 4 * padded // N
        assert seen_["after backward"]["optimizer"] == 0
        # AdamW's two moments on the real elements this rank steps, and a 4-byte step counter for
        # each parameter with a piece here
        real, pieces = ref.owned(m["sizes"], padded, rank)
        assert seen_["after step"]["optimizer"] == 8 * real + 4 * pieces
        assert seen_["after step"]["total"] - formula == 4 * (padded - psi) + 4 * (padded // N - psi / N) \
            + 8 * (real - psi / N) + 4 * pieces
        assert seen_["after zero_grad"]["grads"] == 0


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_fixes_are_one_process_bit_for_bit_in_bitwise_mode(seen):
    """The default-mode exhibits' tolerance (1e-6) is the order of addition alone: with
    bitwise=True, zl.ZeRO(stage=2)'s weights after the token-weighted step, and after two steps,
    saved and consolidated, are torch.equal to plain PyTorch in one process that backwards each
    chunk on its own and adds the gradients in the same fixed tree."""
    results, root = seen
    tokens, trained = ref.tokens_chunked(), ref.mlp_chunked(2)
    for r in results:
        assert _equal(r["bitwise"]["tokens"], tokens)
        assert _equal(r["bitwise"]["checkpoint"], trained)
    assert _equal(zl.checkpoint.consolidate(os.path.join(root, "ckpt-bitwise")), trained)


def test_the_fixed_tree_is_neighbours_first():
    """(1 + u) + (u + u), u half of fp32's last place at 1: the pair (u + u) survives; added one by
    one, each u is lost to rounding."""
    one, u = torch.tensor([1.0]), torch.tensor([2.0**-24])
    assert torch.equal(ref.tree_sum([one, u, u, u]), torch.tensor([1.0 + 2.0**-23]))
    assert torch.equal(((one + u) + u) + u, one)


def test_a_naive_conversion_corrupts_and_zerolabs_consolidate_does_not(seen):
    results, root = seen
    c = results[0]["checkpoint"]
    naive = ref.concatenate_slices([r["checkpoint"]["slices"] for r in results], c["layout"])
    assert ref.worst(naive, c["full"]) > 0.1                          # the failure: shifted by padding
    assert {k: tuple(v.shape) for k, v in naive.items()} == {k: tuple(v.shape) for k, v in c["full"].items()}
    path = os.path.join(root, "ckpt")
    assert ref.worst(zl.checkpoint.consolidate(path), c["full"]) == 0
    assert ref.worst(c["full"], ref.mlp_one_process(2)) < 1e-6
    shard = sorted(f for f in os.listdir(path) if f.startswith("shard-"))[0]
    with open(os.path.join(path, shard), "r+b") as f:                 # one byte changed on disk
        f.seek(os.path.getsize(os.path.join(path, shard)) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=shard):
        zl.checkpoint.consolidate(path)
