"""The peers' engines, built in one place: PyTorch's DistributedDataParallel, ZeroRedundancyOptimizer
beside it, FSDP2's fully_shard and DeepSpeed's config, the way each one's own users build them.
The CPU benchmark (zerolab.bench.engines) and the GPU scripts (gpu/) both build their peers here,
so a table on a laptop and one on a GPU box compare zerolab with the same configurations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def torch_ddp(model, bucket_mb, device=None):
    """PyTorch's DistributedDataParallel with zerolab's bucket size (bucket_cap_mb); on a GPU the
    model's device is the one device DDP replicates on (device_ids)."""
    from torch.nn.parallel import DistributedDataParallel
    on_gpu = device is not None and torch.device(device).type == "cuda"
    return DistributedDataParallel(model, bucket_cap_mb=bucket_mb,
                                   device_ids=[torch.device(device).index] if on_gpu else None)


def zero_redundancy(model, bucket_mb, lr, device=None):
    """(DDP around the model, a ZeroRedundancyOptimizer of AdamW over it): PyTorch's ZeRO-1."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    m = torch_ddp(model, bucket_mb, device)
    return m, ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)


def fsdp2(model, reshard, device_type="cpu", bf16=False):
    """FSDP2 as its documentation applies it: fully_shard on every block, then on the root.
    reshard=False keeps the parameters gathered from forward to backward (ZeRO-2's peer).
    device_type names the mesh's device: on the CPU it must be said, or FSDP2's default mesh
    picks CUDA whenever a GPU exists. bf16: parameters and gradient reductions in bf16
    (MixedPrecisionPolicy), matched to zerolab's precision="bf16"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    options = {"reshard_after_forward": reshard, "mesh": mesh}
    if bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


# what DeepSpeed's peers clip the gradient's norm to: 0.0, no clipping, as every other engine here
# (a GPU result file records it as "deepspeed_gradient_clipping": zerolab.book.gpu_results.clipped)
DEEPSPEED_GRADIENT_CLIPPING = 0.0

def deepspeed_config(stage, batch, bucket_mb, *, bf16=False, overlap=False, adamw_lr=None,
                     offload_optimizer=False):
    """DeepSpeed's config for one stage, with the same bucket size as every other engine: the one
    place the peers' DeepSpeed runs are configured (this bench, and gpu/ on a GPU box).

    bucket_mb counts MiB of the dtype communicated (fp32, or bf16 with bf16=True); DeepSpeed's
    bucket sizes count ELEMENTS, and default to 5e8 (reduce_bucket_size, allgather_bucket_size)
    and 5e7 (stage3_prefetch_bucket_size): buffers of gigabytes, sized for GPUs, which would swamp
    the memory column of a model of a few MB (deepspeed/runtime/zero/config.py). bucket_mb=None
    keeps DeepSpeed's defaults. overlap: its GPU fast path (overlap_comm, contiguous_gradients).
    adamw_lr: DeepSpeed builds its own AdamW (its fused kernel on a GPU) instead of the script's.
    offload_optimizer: ZeRO-Offload, the optimizer's state and step on the host (pinned).
    """
    zero = {"stage": stage}
    if bucket_mb is not None:
        elements = max(1, int(bucket_mb * 2 ** 20 / (2 if bf16 else 4)))
        zero["reduce_bucket_size"] = elements
        if stage in (1, 2) or overlap:
            zero["allgather_bucket_size"] = elements        # the parameter all-gather after the step
        if stage == 3 and not overlap:
            zero["stage3_prefetch_bucket_size"] = elements  # stage 3 gathers by this one instead
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if overlap:
        zero.update(overlap_comm=True, contiguous_gradients=True)
    # gradient_clipping: DeepSpeed clips the gradient's norm to 1.0 unless told otherwise
    # (GRADIENT_CLIPPING_DEFAULT, deepspeed/runtime/constants.py); no other engine here clips
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10 ** 9, "gradient_clipping": DEEPSPEED_GRADIENT_CLIPPING}
    if bf16:
        config["bf16"] = {"enabled": True}
    if adamw_lr is None:
        config["zero_allow_untested_optimizer"] = True     # the script's own torch.optim.AdamW
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": adamw_lr}}
    config["zero_optimization"] = zero
    return config


def quiet_deepspeed():
    """DeepSpeed logs to stdout with a timestamp on every line: keep only its errors, so what
    a run prints is the same from one run to the next. And it is not made to compile what its
    training does not use (below)."""
    import logging
    skip_shared_memory_op()     # (first: importing DeepSpeed sets its logger's level)
    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.setLevel(logging.ERROR)
    for handler in ds_logger.handlers:
        handler.setLevel(logging.ERROR)


def skip_shared_memory_op():
    """On a CPU, DeepSpeed's communication backend compiles a C++ op at start-up (its shared-memory
    all-reduce, deepspeed_shm_comm): half a minute of compiling in every new environment, since
    the build is keyed on the paths of this Python's torch. Only inference_all_reduce uses it;
    ZeRO's training collectives are torch.distributed's. Marked incompatible, the op is not built
    (inference_all_reduce would fall back to torch.distributed's all_reduce): the engines compared
    run exactly the same code."""
    try:
        import deepspeed.ops
        compatible = deepspeed.ops.__compatible_ops__
    except Exception:  # noqa: BLE001 - no DeepSpeed, or another version's layout: nothing to skip
        return
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
