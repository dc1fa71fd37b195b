"""Bad input, tried systematically: every public entry point (launch, the engines, the memory
model, checkpoints, the command line) fed wrong types, out-of-range values and inconsistent
combinations. Each must raise a specific exception whose message names the argument, before
any process starts and before anything changes (the model's tensors stay where and what they
were; no checkpoint file appears)."""

import functools
import os

import pytest
import torch

import zerolab as zl
from zerolab import checkpoint, memory, models
from zerolab.data import CharDataset

pytestmark = pytest.mark.slow     # launches ranks or processes (make test-fast leaves it out)

ADAM = functools.partial(torch.optim.AdamW, lr=1e-3)


def _model():
    torch.manual_seed(0)
    return models.AwkwardModel()


def _frozen_model():
    m = _model()
    m.requires_grad_(False)
    return m


def _meta_gpt():
    with torch.device("meta"):
        return models.GPT(models.gpt_config("nano"))


def _nested():
    def inner():
        return 1
    return inner


def top_level():
    return 1


TOP_LAMBDA = lambda: 1  # noqa: E731 - the point of the case


def _engine():
    return zl.SingleProcess(_model(), ADAM)


# (id, function of (model, tmp_path) that makes the call, exception, words its message contains)
CASES = [
    # ---- zl.launch
    ("launch fn not callable", lambda m, d: zl.launch("train.py", 2), TypeError, "fn must be a function"),
    ("launch lambda", lambda m, d: zl.launch(TOP_LAMBDA, 2), ValueError, "fn is a lambda"),
    ("launch nested fn", lambda m, d: zl.launch(_nested(), 2), ValueError, "defined inside another function"),
    ("launch world_size 0", lambda m, d: zl.launch(top_level, 0), ValueError, "world_size must be >= 1"),
    ("launch world_size -3", lambda m, d: zl.launch(top_level, -3), ValueError, "world_size must be >= 1"),
    ("launch world_size str", lambda m, d: zl.launch(top_level, "2"), TypeError, "world_size must be an int"),
    ("launch world_size float", lambda m, d: zl.launch(top_level, 2.0), TypeError, "world_size must be an int"),
    ("launch world_size bool", lambda m, d: zl.launch(top_level, True), TypeError, "world_size must be an int"),
    ("launch timeout 0", lambda m, d: zl.launch(top_level, 2, timeout=0), ValueError, "timeout must be a finite number of seconds > 0"),
    ("launch timeout -1", lambda m, d: zl.launch(top_level, 2, timeout=-1), ValueError, "timeout must be a finite number of seconds > 0"),
    ("launch timeout str", lambda m, d: zl.launch(top_level, 2, timeout="60"), ValueError, "timeout"),
    ("launch backend mpi", lambda m, d: zl.launch(top_level, 2, backend="mpi"), ValueError, "backend must be None"),
    ("launch args not tuple", lambda m, d: zl.launch(top_level, 2, args=5), TypeError, "args must be a tuple"),
    # ---- engines: zl.DDP, zl.NaiveDDP, zl.ZeRO (stages 1-3), zl.SingleProcess
    ("DDP model str", lambda m, d: zl.DDP("gpt", ADAM), TypeError, "model must be a torch.nn.Module"),
    ("DDP optimizer of another model", lambda m, d: zl.DDP(m, torch.optim.SGD(_frozen_model().parameters(), lr=0.1)),
     TypeError, "not this model's parameters"),
    ("DDP optimizer int", lambda m, d: zl.DDP(m, 3), TypeError, "optimizer must be a torch optimizer"),
    ("DDP no optimizer, bf16", lambda m, d: zl.DDP(m, precision="bf16"), ValueError, "fp32 only"),
    ("DDP no optimizer, max_grad_norm", lambda m, d: zl.DDP(m, max_grad_norm=1.0), ValueError,
     "torch.nn.utils.clip_grad_norm_"),
    ("CombinedOptimizer of a class", lambda m, d: zl.CombinedOptimizer(torch.optim.AdamW), TypeError,
     "CombinedOptimizer takes torch optimizers"),
    ("ZeRO-2 Muon on the matrices only", lambda m, d: zl.ZeRO(
        m, torch.optim.Muon([p for p in m.parameters() if p.ndim == 2]), stage=2), TypeError,
     "zl.CombinedOptimizer(muon, adamw)"),
    ("DDP LBFGS", lambda m, d: zl.DDP(m, functools.partial(torch.optim.LBFGS, lr=1)), TypeError,
     "LBFGS needs a closure"),
    ("single LBFGS factory", lambda m, d: zl.SingleProcess(m, lambda ps: torch.optim.LBFGS(ps)), TypeError,
     "closure"),
    ("DDP bucket_mb 0", lambda m, d: zl.DDP(m, ADAM, bucket_mb=0), ValueError, "bucket_mb must be a number > 0"),
    ("DDP bucket_mb -1", lambda m, d: zl.DDP(m, ADAM, bucket_mb=-1), ValueError, "bucket_mb"),
    ("DDP bucket_mb nan", lambda m, d: zl.DDP(m, ADAM, bucket_mb=float("nan")), ValueError, "bucket_mb"),
    ("DDP bucket_mb inf", lambda m, d: zl.DDP(m, ADAM, bucket_mb=float("inf")), ValueError, "bucket_mb"),
    ("DDP bucket_mb str", lambda m, d: zl.DDP(m, ADAM, bucket_mb="25"), ValueError, "bucket_mb"),
    ("DDP bucket_mb bool", lambda m, d: zl.DDP(m, ADAM, bucket_mb=True), ValueError, "bucket_mb"),
    ("DDP precision fp64", lambda m, d: zl.DDP(m, ADAM, precision="fp64"), ValueError, "unknown precision 'fp64'"),
    ("DDP precision dtype", lambda m, d: zl.DDP(m, ADAM, precision=torch.float16), ValueError, "unknown precision"),
    ("DDP max_grad_norm 0", lambda m, d: zl.DDP(m, ADAM, max_grad_norm=0), ValueError, "max_grad_norm"),
    ("DDP max_grad_norm str", lambda m, d: zl.DDP(m, ADAM, max_grad_norm="1"), ValueError, "max_grad_norm"),
    ("DDP all frozen", lambda m, d: zl.DDP(_frozen_model(), ADAM), ValueError, "no trainable parameters"),
    ("NaiveDDP precision", lambda m, d: zl.NaiveDDP(m, ADAM, precision="int8"), ValueError, "unknown precision"),
    ("NaiveDDP max_grad_norm -1", lambda m, d: zl.NaiveDDP(m, ADAM, max_grad_norm=-1), ValueError,
     "max_grad_norm"),
    ("Single model None", lambda m, d: zl.SingleProcess(None, ADAM), TypeError, "model must be a torch.nn.Module"),
    ("Single precision", lambda m, d: zl.SingleProcess(m, ADAM, precision="fp8"), ValueError, "unknown precision"),
    ("ZeRO stage 0", lambda m, d: zl.ZeRO(m, ADAM, stage=0), ValueError, "stage must be 1"),
    ("ZeRO stage 4", lambda m, d: zl.ZeRO(m, ADAM, stage=4), ValueError, "stage must be 1"),
    ("ZeRO stage str", lambda m, d: zl.ZeRO(m, ADAM, stage="2"), ValueError, "stage must be 1"),
    ("ZeRO stage bool", lambda m, d: zl.ZeRO(m, ADAM, stage=True), ValueError, "stage must be 1"),
    ("ZeRO stage missing", lambda m, d: zl.ZeRO(m, ADAM), ValueError, "stage must be 1"),
    ("ZeRO-1 bucket_mb 0", lambda m, d: zl.ZeRO(m, ADAM, stage=1, bucket_mb=0), ValueError, "bucket_mb"),
    ("ZeRO-2 precision", lambda m, d: zl.ZeRO(m, ADAM, stage=2, precision="half"), ValueError,
     "unknown precision 'half'"),
    ("ZeRO-2 model list", lambda m, d: zl.ZeRO([m], ADAM, stage=2), TypeError, "model must be a torch.nn.Module"),
    ("ZeRO-3 prefetch -1", lambda m, d: zl.ZeRO(m, ADAM, stage=3, prefetch=-1), ValueError, "prefetch must be an int"),
    ("ZeRO-3 prefetch float", lambda m, d: zl.ZeRO(m, ADAM, stage=3, prefetch=1.5), ValueError, "prefetch"),
    ("ZeRO-3 prefetch bool", lambda m, d: zl.ZeRO(m, ADAM, stage=3, prefetch=True), ValueError, "prefetch"),
    ("ZeRO-3 bucket_mb -2", lambda m, d: zl.ZeRO(m, ADAM, stage=3, bucket_mb=-2), ValueError, "bucket_mb"),
    ("ZeRO-3 meta without init_fn", lambda m, d: zl.ZeRO(_meta_gpt(), ADAM, stage=3), ValueError, "init_fn"),
    ("ZeRO-3 unknown unit", lambda m, d: zl.ZeRO(m, ADAM, stage=3, units=["blocks.9"]), ValueError,
     "units: no submodule named 'blocks.9'"),
    # ---- the memory model
    ("model_state_bytes psi 0", lambda m, d: memory.model_state_bytes(0, 8, 1), ValueError, "psi"),
    ("model_state_bytes psi -1", lambda m, d: memory.model_state_bytes(-1, 8, 1), ValueError, "psi"),
    ("model_state_bytes psi str", lambda m, d: memory.model_state_bytes("7.5e9", 8, 1), ValueError, "psi"),
    ("model_state_bytes n_d 0", lambda m, d: memory.model_state_bytes(7.5e9, 0, 1), ValueError, "n_d"),
    ("model_state_bytes n_d float", lambda m, d: memory.model_state_bytes(7.5e9, 1.5, 1), ValueError, "n_d"),
    ("model_state_bytes stage 4", lambda m, d: memory.model_state_bytes(7.5e9, 8, 4), ValueError, "stage must be 0"),
    ("model_state_bytes stage str", lambda m, d: memory.model_state_bytes(7.5e9, 8, "os"), ValueError, "stage"),
    ("model_state_bytes k -1", lambda m, d: memory.model_state_bytes(7.5e9, 8, 1, k=-1), ValueError, "k (optimizer"),
    ("max_params device_bytes 0", lambda m, d: memory.max_params(0, 8, 1), ValueError, "device_bytes"),
    ("max_params n_m 0", lambda m, d: memory.max_params(32e9, 8, 1, n_m=0), ValueError, "n_m"),
    ("max_params stage -1", lambda m, d: memory.max_params(32e9, 8, -1), ValueError, "stage"),
    ("bytes_per_param n_d 0", lambda m, d: memory.bytes_per_param(0, 1), ValueError, "n_d"),
    ("batch rank out of range", lambda m, d: CharDataset(32).batch(0, 2, rank=2, world_size=2), ValueError,
     "rank must be in [0, 2)"),
    ("batch batch_size 0", lambda m, d: CharDataset(32).batch(0, 0), ValueError, "batch_size"),
    # ---- zl.checkpoint
    ("save engine is a model", lambda m, d: checkpoint.save(m, d / "ck"), TypeError, "engine must be a zerolab engine"),
    ("save path int", lambda m, d: checkpoint.save(_engine(), 3), TypeError, "path must be a str"),
    ("save extra list", lambda m, d: checkpoint.save(_engine(), d / "ck", extra=[1]), TypeError, "extra must be a dict"),
    ("load engine None", lambda m, d: checkpoint.load(None, d), TypeError, "engine must be a zerolab engine"),
    ("load path None", lambda m, d: checkpoint.load(_engine(), None), TypeError, "path must be a str"),
    ("load no such dir", lambda m, d: checkpoint.load(_engine(), d / "nope"), checkpoint.CheckpointError,
     "no such checkpoint directory"),
    ("load empty dir", lambda m, d: checkpoint.load(_engine(), d), checkpoint.CheckpointError,
     "metadata.json: missing"),
    ("consolidate path list", lambda m, d: checkpoint.consolidate([d]), TypeError, "path must be a str"),
    ("consolidate empty dir", lambda m, d: checkpoint.consolidate(d), checkpoint.CheckpointError, "metadata.json"),
]


def _children():
    out = set()
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        out.add(int(p))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _id(case):
    return (case.values if hasattr(case, "values") else case)[0]


@pytest.mark.parametrize("name, call, error, words", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_is_refused_before_anything_happens(name, call, error, words, tmp_path):
    model = _model()
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    procs = _children()
    files = sorted(os.listdir(tmp_path))
    with pytest.raises(error) as info:
        call(model, tmp_path)
    assert words in str(info.value), f"{name}: {info.value}"
    assert _children() <= procs, "a process was started"
    assert sorted(os.listdir(tmp_path)) == files, "a file was written"
    for k, v in model.state_dict(keep_vars=True).items():
        ptr, value = before[k]
        assert v.data_ptr() == ptr and torch.equal(v, value), f"{name}: {k} changed"


# ---- the command line: exit code 2 (1 for a checkpoint that cannot be read) and a message
CLI_CASES = [
    (["train", "--steps", "0"], 2, "steps must be >= 1"),
    (["train", "--world-size", "0"], 2, "world_size must be >= 1"),
    (["train", "--batch-size", "0"], 2, "batch_size must be >= 1"),
    (["train", "--lr", "0"], 2, "lr must be a finite number > 0"),
    (["train", "--lr", "-1"], 2, "lr must be a finite number > 0"),
    (["train", "--steps", "three"], 2, "argument --steps: invalid int value: 'three'"),
    (["train", "--strategy", "zero4"], 2, "argument --strategy: invalid choice: 'zero4'"),
    (["train", "--precision", "fp8"], 2, "argument --precision: invalid choice: 'fp8'"),
    (["train", "--size", "huge"], 2, "argument --size: invalid choice: 'huge'"),
    (["train", "--save-every", "-1"], 2, "save_every must be an int >= 0"),
    (["train", "--save-every", "x"], 2, "argument --save-every: invalid int value"),
    (["train", "--resume", "/nonexistent/ck"], 2, "resume: /nonexistent/ck holds no checkpoint (neither zerolab's metadata.json nor a torch.distributed.checkpoint's .metadata)"),
    (["train", "--fault", "boom"], 2, "fault must look like KIND@STEP"),
    (["train", "--fault", "melt@2"], 2, "fault: unknown kind 'melt'"),
    (["train", "--fault", "kill@2:5", "--world-size", "2"], 2, "rank in [0, 2)"),
    (["train", "--timeout", "0"], 2, "timeout must be a finite number of seconds > 0"),
    (["train", "--collective-timeout", "-1"], 2, "collective_timeout must be a finite number of seconds > 0"),
    (["train", "--timeout", "inf"], 2, "timeout must be a finite number of seconds > 0 or None"),
    # a raw OverflowError and a raw DistNetworkError inside the ranks, before
    (["train", "--collective-timeout", "1e15"], 2, "collective_timeout must be a finite number of seconds > 0 (at least 1, at most 1e+08), got 1000000000000000.0"),
    (["train", "--collective-timeout", "1e-9"], 2, "(at least 1, at most 1e+08), got 1e-09"),
    # found only after training, before
    (["train", "--plot", "/nonexistent/dir/loss.png"], 2, "plot: the directory '/nonexistent/dir' does not exist"),
    # os.access says yes to /proc for root: only a write tells
    (["train", "--save-every", "1", "--save-dir", "/proc/zerolab-ckpt"], 2, "cannot write a checkpoint there"),
    # raw tracebacks, before: an OverflowError inside AdamW's step; a MemoryError after 49 s
    (["train", "--lr", "1e300"], 2, "lr must be at most 10, got 1e+300"),
    (["train", "--batch-size", "1000000000"], 2, "batch_size 1000000000: one step needs at least 45,776.4 GiB per rank"),
    (["consolidate", "/nonexistent/ck", "/nonexistent/dir/x.pt"], 2, "the directory '/nonexistent/dir' does not exist"),
    (["consolidate", "/nonexistent/ck", "/proc/x.pt"], 2, "cannot write '/proc/x.pt'"),
    (["bench", "--size", "bogus"], 2, "argument --size: invalid choice: 'bogus'"),
    (["bench", "--bucket-mb", "inf"], 2, "--bucket-mb must be a finite number > 0, got inf"),
    (["consolidate", "/nonexistent/ck", "out.pt"], 1, "/nonexistent/ck: no such checkpoint directory"),
    (["consolidate", "/nonexistent/ck"], 2, "the following arguments are required: out"),
    (["explode"], 2, "invalid choice: 'explode'"),
]


@pytest.mark.parametrize("argv, code, words", CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_cli_refuses_bad_arguments(argv, code, words, capsys, tmp_path, monkeypatch):
    from zerolab.__main__ import main
    monkeypatch.chdir(tmp_path)
    procs = _children()
    try:
        got = main([*argv, "--no-progress"] if argv[0] == "train" else argv)
    except SystemExit as exc:  # argparse's usage error
        got = exc.code
    out, err = capsys.readouterr()
    assert got == code, err
    assert words in err, err
    assert out == "" and "Traceback" not in err, out + err     # one error, before any header or work
    assert _children() <= procs and os.listdir(tmp_path) == []


def test_the_table_is_large():
    # the report quotes this number
    assert len(CASES) + len(CLI_CASES) >= 80


@pytest.mark.filterwarnings("ignore:ZeRO3")     # (the model has no block list: one unit)
def test_a_whole_tensor_optimizer_is_accepted_by_every_engine():
    """A factory that hides its class (a lambda) builds Adafactor on every engine: the sharded ones
    hand it whole what a shard's edge cuts (zerolab.engines.whole_matrix; against one process at 2
    and 4 ranks: tests/conformance/test_whole_matrix.py)."""
    adafactor = lambda ps: torch.optim.Adafactor(ps, lr=1e-2)  # noqa: E731 - the point of the case
    for engine in (zl.DDP, zl.NaiveDDP, zl.SingleProcess, zl.ZeRO1, zl.ZeRO2, zl.ZeRO3):
        assert isinstance(engine(_model(), adafactor).optimizer, torch.optim.Adafactor)
