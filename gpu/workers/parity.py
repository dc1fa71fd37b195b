"""Parity on the GPU (gpu/parity.py): every engine against one process on the global batch, and
which collectives the process group runs on CUDA tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerolab as zl
from gpu.common import backend_name, compute_device
from gpu.workers.engines import OPT, make_engine
from zerolab.data import CharDataset
from zerolab.models import GPT, gpt_config, gpt_loss

# the parity tests' settings (tests/test_zero.py)
STEPS = 3
ENGINES = ("zl.DDP", "zl.ZeRO-1", "zl.ZeRO-2", "zl.ZeRO-3", "zl.ZeRO-3 prefetch=0")


def parity_worker(precisions=("fp32", "bf16"), engines=ENGINES):
    """Each engine, STEPS steps of the nano GPT on this rank's share of the global batch."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = compute_device()
    data = CharDataset(32)
    out = {"backend": backend_name(), "device": str(dev), "runs": {}}
    for precision in precisions:
        for name in engines:
            key = f"{name} {precision}"
            try:
                torch.manual_seed(0 if rank == 0 else 100 + rank)   # the broadcast must fix rank > 0
                model = GPT(gpt_config("nano", bias=False)).to(dev)
                eng = make_engine(name, model, precision, bucket_mb=0.02)
                losses = []
                for s in range(STEPS):
                    x, y = (t.to(dev) for t in data.batch(s, 2, rank, n))
                    _, loss = gpt_loss(eng, (x, y))
                    eng.backward(loss)
                    eng.step()
                    eng.zero_grad()
                    losses.append(loss.item())
                sd = {k: v.detach().float().cpu() for k, v in eng.full_state_dict().items()}
                out["runs"][key] = {"ok": True, "state": sd, "losses": losses}
            except Exception as e:  # noqa: BLE001 - recorded: what runs and what does not
                out["runs"][key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            finally:
                torch.cuda.synchronize() if dev.type == "cuda" else None
    return out


def reference_state(n, precision, dev):
    """One process, the global batch: plain torch in fp32, zl.SingleProcess in bf16."""
    torch.manual_seed(0)
    model = GPT(gpt_config("nano", bias=False)).to(dev)
    data = CharDataset(32)
    if precision == "fp32":
        opt = OPT(model.parameters())
        for s in range(STEPS):
            x, y = (t.to(dev) for t in data.batch(s, 2 * n))
            gpt_loss(model, (x, y))[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    eng = zl.SingleProcess(model, OPT, precision=precision, track_peak=False)
    for s in range(STEPS):
        x, y = (t.to(dev) for t in data.batch(s, 2 * n))
        eng.backward(gpt_loss(eng, (x, y))[1])
        eng.step()
        eng.zero_grad()
    return {k: v.detach().float().cpu() for k, v in eng.full_state_dict().items()}


def collectives_probe():
    """Which collectives this process group runs on CUDA tensors (gloo's CUDA support is partial)."""
    dev = compute_device()
    n = dist.get_world_size()
    out = {"backend": backend_name(), "device": str(dev)}
    tests = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(8, device=dev)),
        "broadcast": lambda: dist.broadcast(torch.ones(8, device=dev), 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8 * n, device=dev),
                                                                      torch.ones(8, device=dev)),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(8, device=dev),
                                                                    torch.ones(8 * n, device=dev)),
        "all_reduce on a CPU tensor": lambda: dist.all_reduce(torch.ones(8)),
    }
    for name, fn in tests.items():
        try:
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out
