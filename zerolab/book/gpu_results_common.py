"""What the GPU results of every chapter share (zerolab.book.gpu_results shows chapters 2 to 10,
zerolab.book.gpu_results_ch11_13 chapters 11 to 13): where the result files are, the line that says
where a table was measured, and how each engine's rows ran (precision, DeepSpeed's clipping).
"""

from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "gpu",
                       "results")


def header(machine: dict, script: str = "gpu/run_all.sh") -> str:
    return (f"**Measured on a GPU ({machine['device']}, {machine['date']})**: torch {machine['torch']}, "
            f"CUDA {machine['cuda']}, NCCL {machine['nccl']}, driver {machine['driver']}; "
            f"written by `{script}`, not re-run here.")


# How each engine keeps its numbers in the GPU runs (gpu.workers, gpu.fastpath: each as its own users run bf16).
PRECISION = {"zl.": "bf16 weights, fp32 master", "PyTorch DDP": "fp32 weights, autocast bf16",
             "FSDP2": "fp32 shards, bf16 compute", "DeepSpeed": "bf16 weights, fp32 master"}


def precision(engine: str) -> str:
    """The precision regime an engine's GPU rows ran in (PyTorch DDP's differs: autocast over fp32)."""
    return next(v for k, v in PRECISION.items() if engine.startswith(k))


def clipped(engine: str, result: dict) -> bool:
    """Whether a GPU row ran with DeepSpeed's default gradient clipping to a norm of 1.0. DeepSpeed clips
    unless its config says "gradient_clipping": 0.0, which zerolab.bench.deepspeed_config has said only
    since every committed GPU file was written; a file records the value it ran with
    ("deepspeed_gradient_clipping") from then on, and one that does not ran with the default."""
    return engine.startswith("DeepSpeed") and result.get("deepspeed_gradient_clipping", 1.0) != 0


CLIP_MARK = "§"
PRECISION_NOTE = ("Precision, as each project's users run bf16: zerolab and DeepSpeed keep bf16 weights and "
                  "gradients with an fp32 master copy and AdamW's moments; FSDP2 keeps fp32 shards, computes on "
                  "gathered bf16 copies and reduces in bf16; PyTorch DDP runs `torch.autocast` over fp32 weights, "
                  "so its gradients, their reduction and AdamW are fp32, and the operations autocast leaves "
                  "alone read and write fp32. The model's FLOPs are the same in all four; the bytes they move "
                  "are not.")
CLIP_NOTE = (f"{CLIP_MARK} Measured with DeepSpeed's default gradient clipping to a norm of 1.0, which no other row "
             "does: each step scaled every gradient by the clip factor (in stages 1 and 2 a pass over the "
             "gradients DeepSpeed skips without clipping; the norm itself is computed either way), and the clipped "
             "updates train another trajectory than the other rows'. `zerolab.bench.deepspeed_config`, which the GPU "
             "scripts use too, now sets `\"gradient_clipping\": 0.0` (chapter 10's CPU bench runs with it); these rows "
             "wait for a GPU to be measured again.")
