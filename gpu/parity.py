"""Every engine's parity on the GPU: world 1 on NCCL, world 2 on gloo with CUDA tensors.

    python -m gpu.parity OUT.json

Each engine trains the nano GPT (bias=False, as tests/test_zero.py) for 3 AdamW steps on its
share of the global batch; the parent trains one process on the global batch (plain torch in
fp32, zl.SingleProcess in bf16) on the same device and compares every tensor (max |diff|).
Tolerances are the library tests': fp32 1e-6, bf16 2e-3.
"""

from __future__ import annotations

import subprocess
import sys

import torch

import zerolab as zl
from gpu.common import compute_device, write_json
from gpu.workers.parity import collectives_probe, parity_worker, reference_state

TOL = {"fp32": 1e-6, "bf16": 2e-3}

PURE_NCCL_PROBE = r"""
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
try:
    dist.all_reduce(torch.ones(4)); print("ok")
except Exception as e:
    print(type(e).__name__ + ": " + str(e).splitlines()[0][:200])
dist.destroy_process_group()
"""


def main(path):
    dev = compute_device() if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else dev
    result = {"what": "parity of every zerolab engine against one process on the global batch",
              "steps": 3, "model": "GPT nano (bias=False), CharDataset(32), 2 sequences per rank",
              "tolerance": TOL, "worlds": {}}
    if torch.cuda.is_available():
        p = subprocess.run([sys.executable, "-c", PURE_NCCL_PROBE], capture_output=True, text=True, timeout=120)
        result["pure_nccl_cpu_tensor"] = (p.stdout.strip() or p.stderr.strip()[-300:])
        result["pure_nccl_note"] = ("a process group of NCCL alone, given a CPU tensor (what every chapter "
                                    "and test does at world_size 1 on a GPU box before zerolab.launch "
                                    "initialised 'cpu:gloo,cuda:nccl')")
    refs = {}
    for n in (1, 2):
        backend = None if n == 1 else "gloo"
        entry = {}
        try:
            entry["collectives"] = zl.launch(collectives_probe, n, backend=backend, timeout=120)[0]
            ranks = zl.launch(parity_worker, n, backend=backend, timeout=400)
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {str(e)[-800:]}"
            result["worlds"][str(n)] = entry
            print(f"world {n}: launch failed: {entry['error'][:300]}", flush=True)
            continue
        entry["backend"], entry["device"] = ranks[0]["backend"], ranks[0]["device"]
        entry["engines"] = {}
        for key, run in ranks[0]["runs"].items():
            name, precision = key.rsplit(" ", 1)
            if not run["ok"] or not all(r["runs"][key]["ok"] for r in ranks):
                err = next(r["runs"][key]["error"] for r in ranks if not r["runs"][key]["ok"])
                entry["engines"][key] = {"ran": False, "error": err}
                print(f"world {n} {key}: FAILED {err[:200]}", flush=True)
                continue
            if (n, precision) not in refs:
                refs[n, precision] = reference_state(n, precision, dev)
            ref = refs[n, precision]
            diff = max((run["state"][k] - ref[k]).abs().max().item() for k in ref)
            same_ranks = all(torch.equal(r["runs"][key]["state"][k], run["state"][k])
                             for r in ranks for k in ref)
            entry["engines"][key] = {"ran": True, "max_abs_diff": diff, "pass": diff <= TOL[precision],
                                     "ranks_identical": same_ranks, "losses_rank0": run["losses"]}
            print(f"world {n} ({entry['backend']}, {entry['device']}) {key:28s} max|diff| {diff:.2e} "
                  f"{'PASS' if diff <= TOL[precision] else 'FAIL'} (tol {TOL[precision]})", flush=True)
        result["worlds"][str(n)] = entry
    write_json(path, result)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "parity.json")
