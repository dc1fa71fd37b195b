"""The engines' bitwise mode (bitwise=True, engines.options.BITWISE): zl.SingleProcess on one
process and zl.DDP and zl.ZeRO(stage=1, 2 and 3) on 1, 2, 4 and 8 gloo ranks end with
torch.equal weights and optimizer state, and those equal zerolab.bitwise.BitwiseDataParallel (the
standalone reference trainer) on the same chunks. No tolerance anywhere.

The matrix: the TinyMLP and the nano GPT (and, on its own, a Hugging Face GPT-2), fp32 and bf16
(fp32 masters), AdamW and SGD with momentum, C = 8 chunks of the global batch (K = 8, 4, 2, 1
backwards per step on 1, 2, 4, 8 ranks: gradient accumulation as nanoGPT writes it, loss / K), a
clip that binds, one bucket (ZeRO-3: its units; and, for the MLP, four buckets, each padded to
N * 256: the clip's norm is exact, so any layout gives the one-bucket run's bits). Both loops:
PyTorch's (loss.backward(), optimizer.step(), optimizer.zero_grad()) and zerolab's
(engine.backward with nanoGPT's require_backward_grad_sync, engine.clip_grad_norm_, engine.step,
engine.zero_grad).

And: the default mode on the same loop is NOT the same bits across N (the test can fail); a
planted break (the chunks added one after the other instead of in the tree) fails it; every
refusal names what it refuses.
"""

import functools
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.bitwise import BitwiseDataParallel, ChunkPlan
from zerolab.bitwise import buckets as bitwise_buckets
from zerolab.buckets import bucket_order
from zerolab.data import CharDataset, SyntheticRegression
from zerolab.engines import make
from zerolab.models import GPT, TinyMLP, gpt_config, gpt_loss, regression_loss

from helpers import hf_gpt2, tokens

CHUNKS, STEPS = 8, 3
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.01)
ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
CLIP = {"mlp": 0.05, "gpt": 0.3, "hf": 0.3}


@dataclass(frozen=True)
class Case:
    kind: str           # "mlp" | "gpt"
    precision: str      # "fp32" | "bf16"
    optimizer: object

    @property
    def name(self):
        return f"{self.kind}-{self.precision}-{self.optimizer.func.__name__}"


CASES = [Case(k, p, o) for k in ("mlp", "gpt") for p in ("fp32", "bf16") for o in (ADAMW, SGD)]
ENGINES = ("ddp", "zero1", "zero2", "zero3")


class Tokens:
    """Global batches of random token ids for the Hugging Face model: (ids,), its own labels."""

    def global_batch(self, step, rows):
        return (tokens(step, rows),)


def hf_loss(model, batch):
    out = model(input_ids=batch[0], labels=batch[0])     # called with keywords, as HF users do
    return out.logits, out.loss


def build(kind, seed):
    """(model, data, loss_fn, global batch rows), the same model from the same seed."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return TinyMLP(16, 32, 4), SyntheticRegression(16, 4), regression_loss, 16
    if kind == "hf":            # a Hugging Face GPT-2 (tied embeddings), built from seed 0 on every rank
        return hf_gpt2(), Tokens(), hf_loss, 8
    return GPT(gpt_config("nano")), CharDataset(32), gpt_loss, 8


def chunk_of(batch, c, rows):
    per = rows // CHUNKS
    return tuple(t[c * per:(c + 1) * per] for t in batch)


# ------------------------------------------------------------------ on each rank


def engine_run(case, engine_name, bitwise=True, zerolab_loop=False, **options):
    """STEPS steps of `case` on `engine_name`; rank r's k-th backward is chunk r*K + k.
    Returns (trainable weights by name, optimizer state by parameter index, grad norms)."""
    n, r = zl.world_size(), zl.rank()
    model, data, loss_fn, rows = build(case.kind, 0 if r == 0 else 100 + r)   # rank 0's are broadcast
    K = CHUNKS // n
    engine = make(engine_name, model, case.optimizer, precision=case.precision, bitwise=bitwise,
                  **({} if zerolab_loop else {"max_grad_norm": CLIP[case.kind]}), **options)
    norms = []
    for step in range(STEPS):
        batch = data.global_batch(step, rows)
        for k in range(K):
            if zerolab_loop:            # nanoGPT's switch: accepted, and every backward is a chunk all the same
                engine.require_backward_grad_sync = k == K - 1
            loss = loss_fn(engine, chunk_of(batch, r * K + k, rows))[1] / K
            engine.backward(loss) if zerolab_loop else loss.backward()
        if zerolab_loop:
            norms.append(engine.clip_grad_norm_(CLIP[case.kind]))
            engine.step()
            engine.zero_grad()
        else:
            engine.optimizer.step()
            engine.optimizer.zero_grad()
            norms.append(engine.last_grad_norm)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    full = engine.full_state_dict()
    state = engine.optimizer.state_dict()["state"]
    return {k: full[k] for k in names}, state, norms


def reference_run(case):
    """zerolab.bitwise.BitwiseDataParallel on one process on the same chunks, its flat vector in
    the engines' bucket order (so its optimizer state compares as one flat tensor)."""
    model, data, loss_fn, rows = build(case.kind, 0)
    trainer = BitwiseDataParallel(model, case.optimizer, loss_fn, ChunkPlan(CHUNKS, 1), precision=case.precision,
                                  max_grad_norm=CLIP[case.kind], params=bucket_order(model))
    for step in range(STEPS):
        trainer.train_step(data.global_batch(step, rows), micro_batches=CHUNKS)
    return trainer.master_state(), trainer.optimizer_state()


def matrix_worker(cases, engines, with_single):
    """Every case on every engine (and SingleProcess and the reference when N = 1) on this rank."""
    out = {}
    for case in cases:
        for name in engines + (("single",) if with_single else ()):
            out[case.name, name] = engine_run(case, name)
            out[case.name, name, "zerolab loop"] = engine_run(case, name, zerolab_loop=True) \
                if case.optimizer is ADAMW else None
            # four buckets of the MLP (bucket_mb: ~130 fp32 elements; ZeRO-3 has units instead)
            out[case.name, name, "buckets"] = engine_run(case, name, bucket_mb=0.0005) \
                if case.kind == "mlp" and name != "zero3" else None
        if with_single:
            out[case.name, "reference"] = reference_run(case)
    return out


def default_worker(case):
    """The default mode (bitwise=False) on the same chunks and loop."""
    return engine_run(case, "ddp", bitwise=False)[0]


class SequentialTrees(bitwise_buckets.ChunkTrees):
    """A planted break: each rank adds its chunks one after the other, not in the tree."""

    def add(self, leaves):
        if not hasattr(self, "sums") or self.sums is None:
            self.sums, self.count = [leaf.clone() for leaf in leaves], 1
        else:
            for s, leaf in zip(self.sums, leaves):
                s.add_(leaf)
            self.count += 1

    @property
    def backwards(self):
        return getattr(self, "count", 0) or 0

    def roots(self):
        sums, self.sums, self.count = self.sums, None, 0
        return sums


def planted_worker(case):
    bitwise_buckets.ChunkTrees = SequentialTrees
    return engine_run(case, "ddp")[0]


# ------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def runs():
    """{N: rank 0's results}; every rank's weights equal rank 0's."""
    out = {}
    for n in (1, 2, 4, 8):
        ranks = zl.launch(matrix_worker, n, args=(CASES, ENGINES, n == 1))
        for r, results in enumerate(ranks[1:], start=1):
            for key, value in results.items():
                if value is not None and key[-1] != "reference":
                    assert all(torch.equal(value[0][k], ranks[0][key][0][k]) for k in value[0]), f"{key}: rank {r}"
        out[n] = ranks[0]
    return out


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def same_state(a, b):
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k]))
                                           for k in a[i]) for i in a)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_single_process_is_the_reference_trainer(runs, case):
    weights, state, norms = runs[1][case.name, "single"]
    ref_weights, ref_state = runs[1][case.name, "reference"]
    assert same_weights(weights, ref_weights), case.name
    params = list(range(len(weights)))[::-1]                 # the reference's flat order: bucket order
    for key, flat in ref_state.items():
        if key == "step":
            assert all(float(state[i]["step"]) == float(flat) for i in params)
        else:
            assert torch.equal(torch.cat([state[i][key].reshape(-1) for i in params]), flat), f"{case.name}: {key}"
    assert any(x > CLIP[case.kind] for x in norms), f"{case.name}: the clip never bound {norms}"


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_engine_at_every_world_size_is_one_process(runs, case, engine, n):
    weights1, state1, norms1 = runs[1][case.name, "single"]
    weights, state, norms = runs[n][case.name, engine]
    assert same_weights(weights, weights1), f"{case.name} on {engine} at N={n}"
    assert same_state(state, state1), f"{case.name} on {engine} at N={n}: optimizer state"
    assert norms == norms1
    loop = runs[n][case.name, engine, "zerolab loop"]
    if loop is not None:        # engine.backward / clip_grad_norm_ / step / zero_grad
        weights1, state1, norms1 = runs[1][case.name, "single", "zerolab loop"]
        assert same_weights(loop[0], weights1) and same_state(loop[1], state1) and loop[2] == norms1
    many = runs[n][case.name, engine, "buckets"]
    if many is not None:        # four buckets, each padded to N * 256: one bucket's bits all the same
        weights1, state1, norms1 = runs[1][case.name, "single"]
        assert same_weights(many[0], weights1) and same_state(many[1], state1) and many[2] == norms1


@pytest.mark.slow
def test_the_default_mode_and_a_planted_break_are_not_the_same_bits():
    """The same loop with bitwise=False, and with the chunks added one after the other: other
    bits at N = 2 and 4 than at N = 1 (so the tests above can fail)."""
    case = Case("gpt", "fp32", ADAMW)
    for worker in (default_worker, planted_worker):
        one = zl.launch(worker, 1, args=(case,))[0]
        for n in (2, 4):
            assert not same_weights(zl.launch(worker, n, args=(case,))[0], one), f"{worker.__name__} at N={n}"


HF_CASES = [Case("hf", p, ADAMW) for p in ("fp32", "bf16")]


def hf_worker(engines):
    return {(case.name, name): engine_run(case, name) for case in HF_CASES for name in engines}


@pytest.mark.slow
def test_a_hugging_face_gpt2_is_one_process_on_every_engine():
    """transformers' GPT2LMHeadModel (tied embeddings, called with keywords) on every engine at
    N = 2 and 4, fp32 and bf16, K = 4 and 2 chunks a rank, a binding clip: torch.equal to one process."""
    one = zl.launch(hf_worker, 1, args=(("single",),))[0]
    for n in (2, 4):
        ranks = zl.launch(hf_worker, n, args=(ENGINES,))
        for case in HF_CASES:
            weights1, state1, norms1 = one[case.name, "single"]
            assert any(x > CLIP["hf"] for x in norms1), norms1
            for name in ENGINES:
                weights, state, norms = ranks[0][case.name, name]
                assert same_weights(weights, weights1), f"{case.name} on {name} at N={n}"
                assert same_state(state, state1) and norms == norms1, f"{case.name} on {name} at N={n}"


# ------------------------------------------------------------------ the script's own optimizer


def script_optimizer_run(optimizer_kind):
    """zl.DDP(model, bitwise=True) with no optimizer of its own, as torch's DDP, and the script's:
    zl.ShardedOptimizer(bitwise=True), or torch's AdamW ("single": zl.SingleProcess(bitwise=True)
    and its optimizer, the reference). nanoGPT's loop: require_backward_grad_sync on the last
    chunk, loss.backward(), optimizer.step(), optimizer.zero_grad()."""
    n, r = zl.world_size(), zl.rank()
    model, data, loss_fn, rows = build("gpt", 0 if r == 0 else 100 + r)
    K = CHUNKS // n
    if optimizer_kind == "single":
        engine = zl.SingleProcess(model, ADAMW, bitwise=True)
        optimizer = engine.optimizer
    else:
        engine = zl.DDP(model, bitwise=True)
        optimizer = zl.ShardedOptimizer(model.parameters(), torch.optim.AdamW, bitwise=True, lr=3e-3,
                                        weight_decay=0.1) if optimizer_kind == "sharded" \
            else ADAMW(model.parameters(), foreach=False)
    for step in range(STEPS):
        batch = data.global_batch(step, rows)
        for k in range(K):
            engine.require_backward_grad_sync = k == K - 1
            (loss_fn(engine, chunk_of(batch, r * K + k, rows))[1] / K).backward()
        optimizer.step()
        optimizer.zero_grad()
    weights = engine.full_state_dict() if optimizer_kind == "single" else \
        {k: v.detach().clone() for k, v in model.named_parameters()}
    # forgetting zero_grad() after a step is refused by name at the next backward
    (loss_fn(engine, chunk_of(data.global_batch(0, rows), r * K, rows))[1] / K).backward()
    if optimizer_kind != "single":
        optimizer.step()
    try:
        (loss_fn(engine, chunk_of(data.global_batch(0, rows), r * K, rows))[1] / K).backward()
        said = "no error"
    except RuntimeError as e:
        said = str(e)
    return weights, said


def script_optimizer_worker():
    return {kind: script_optimizer_run(kind) for kind in ("sharded", "torch")}


@pytest.mark.slow
def test_ddp_without_optimizer_beside_the_scripts_optimizer_is_the_same_bits():
    reference = zl.launch(script_optimizer_run, 1, args=("single",))[0][0]
    for n in (1, 2, 4):
        for r, out in enumerate(zl.launch(script_optimizer_worker, n)):
            for kind, (weights, said) in out.items():
                assert same_weights(weights, reference), f"{kind} at N={n}, rank {r}"
                assert "engine.no_sync()" in said and "call optimizer.zero_grad() after each step" in said, (kind, said)


def test_memory_report_counts_the_trees_partial_sums():
    """ZeRO-3 in the mode holds each unit's fp32 tree between backward and step: one full-size
    partial sum after 1 or 2 chunks, two after 3 (a subtree of 2 and a leaf). The closed form:
    that many times 4 bytes per (padded) trained element."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # (zl.ZeRO alone: "trains as one rank")
        model, data, loss_fn, rows = build("gpt", 0)
        engine = zl.ZeRO(model, ADAMW, stage=3, bitwise=True)
    padded = sum(u.buckets["train"].padded_numel for u in engine.units if "train" in u.buckets)
    batch = data.global_batch(0, rows)
    for k, held in enumerate((1, 1, 2)):
        loss_fn(engine, chunk_of(batch, k, rows))[1].backward()
        assert engine.memory_report()["grads"] == held * 4 * padded, k
    engine.optimizer.zero_grad()
    assert engine.memory_report()["grads"] == 0


# ------------------------------------------------------------------ refusals


def mlp():
    torch.manual_seed(0)
    return TinyMLP(16, 32, 4)


def test_refusals_by_name_at_construction():
    with pytest.raises(ValueError, match="bitwise=True with precision='fp16'"):
        zl.SingleProcess(mlp(), ADAMW, precision="fp16", bitwise=True)
    with pytest.raises(ValueError, match="bitwise=True with quantize_weights is not supported: ZeRO\\+\\+"):
        zl.ZeRO(mlp(), ADAMW, stage=3, bitwise=True, quantize_weights=True)
    with pytest.raises(ValueError, match="bitwise=True is not available on NaiveDDP"):
        zl.NaiveDDP(mlp(), ADAMW, bitwise=True)
    with pytest.raises(ValueError, match="Adafactor is not one of SGD, Adam, AdamW"):
        zl.SingleProcess(mlp(), torch.optim.Adafactor, bitwise=True)
    with pytest.raises(ValueError, match="foreach=False"):
        zl.SingleProcess(mlp(), functools.partial(torch.optim.AdamW, foreach=True), bitwise=True)
    with pytest.raises(TypeError, match="bucket_mb only with bitwise=True"):
        zl.SingleProcess(mlp(), ADAMW, bucket_mb=1.0)
    with pytest.raises(ValueError, match="Adafactor is not one of SGD, Adam, AdamW"):
        zl.ShardedOptimizer(mlp().parameters(), torch.optim.Adafactor, bitwise=True)
    with pytest.raises(ValueError, match="foreach=False"):
        zl.ShardedOptimizer(mlp().parameters(), torch.optim.AdamW, bitwise=True, foreach=True)
    with pytest.raises(ValueError, match="bitwise=True with offload='optimizer'"):
        zl.ZeRO(mlp(), ADAMW, stage=1, offload="optimizer", bitwise=True)


def test_a_number_of_backwards_that_is_not_a_power_of_two_is_refused():
    engine = zl.SingleProcess(mlp(), ADAMW, bitwise=True)
    x, y = SyntheticRegression(16, 4).global_batch(0, 6)
    for k in range(3):
        regression_loss(engine, (x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))[1].backward()
    with pytest.raises(ValueError, match="3 backwards before this step.*must be a power of two"):
        engine.optimizer.step()


def uneven_worker():
    engine = zl.DDP(mlp(), ADAMW, bitwise=True)
    x, y = SyntheticRegression(16, 4).global_batch(0, 8)
    for k in range(1 + dist.get_rank()):       # rank 0: one backward, rank 1: two
        regression_loss(engine, (x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]))[1].backward()
    try:
        engine.optimizer.step()
    except ValueError as e:
        return str(e)
    return "stepped"


def three_ranks_worker():
    try:
        zl.DDP(mlp(), ADAMW, bitwise=True)
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.slow
def test_ranks_that_disagree_are_refused_on_every_rank():
    for said in zl.launch(uneven_worker, 2):
        assert "the ranks ran between 1 and 2 backwards" in said
    for said in zl.launch(three_ranks_worker, 3):
        assert "bitwise=True needs a power-of-two number of ranks" in said


# ------------------------------------------------------------------ what a script may do between chunks


ZEROINGS = ("optimizer.zero_grad()", "model.zero_grad()", "optimizer.zero_grad(set_to_none=False)",
            "model.zero_grad(set_to_none=False)")


def between_chunks_worker(engine_name):
    """On 2 ranks, K = 2 chunks a step: (1) torch's own clip line between backward and step is
    refused by name; (2) a zero_grad (the optimizer's or the model's) after the first chunk drops
    it: the step equals one whose first chunk is the second's data again, taken once only."""
    case = Case("mlp", "fp32", ADAMW)
    r, out = zl.rank(), {}
    for how in ("reference",) + ZEROINGS:
        model, data, loss_fn, rows = build(case.kind, 0 if r == 0 else 100 + r)
        engine = make(engine_name, model, case.optimizer, bitwise=True)
        batch = data.global_batch(0, rows)
        first, second = chunk_of(batch, r * 4, rows), chunk_of(batch, r * 4 + 1, rows)
        if how != "reference":          # a chunk, then zeroed: as if it had never run
            (loss_fn(engine, first)[1] / 2).backward()
            zeroing = engine.optimizer if how.startswith("optimizer") else engine.module
            zeroing.zero_grad(set_to_none="False" not in how)
        (loss_fn(engine, second)[1] / 2).backward()
        if how == "reference":
            try:
                torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0)
            except RuntimeError as e:
                out["clip"] = str(e)
        (loss_fn(engine, second)[1] / 2).backward()
        engine.optimizer.step()
        out[how] = engine.full_state_dict()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ENGINES)
def test_between_chunks_torchs_clip_is_refused_and_a_zero_grad_drops_the_chunks_so_far(engine_name):
    for rank, out in enumerate(zl.launch(between_chunks_worker, 2, args=(engine_name,))):
        assert "bitwise=True" in out["clip"] and "clip_grad_norm_" in out["clip"], out["clip"]
        for how in ZEROINGS:
            assert all(torch.equal(out[how][k], out["reference"][k]) for k in out["reference"]), (rank, how)


@pytest.mark.parametrize("engine_name", ("single", "ddp"))
def test_a_grad_scaler_is_refused_under_bitwise(engine_name):
    """Before anything changes: by the step (whose gradients the scaler cannot see), or, where
    the optimizer steps the parameters themselves (SingleProcess in fp32), by p.grad's placeholder."""
    case = Case("mlp", "fp32", SGD)
    model, data, loss_fn, rows = build(case.kind, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # (zl.DDP alone: "trains as one rank")
        engine = make(engine_name, model, case.optimizer, bitwise=True)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(engine, chunk_of(data.global_batch(0, rows), 0, rows))[1]).backward()
    with pytest.raises(RuntimeError, match="bitwise=True"):
        scaler.step(engine.optimizer)
    assert all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
