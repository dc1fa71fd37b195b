"""zerolab: ZeRO from first principles, measured.

    import zerolab as zl
    zl.launch(fn, world_size=2)          # real worker processes, values back in rank order
    zl.memory.model_state_bytes(...)     # the paper's memory model
    zl.memory.model_state_bytes_measured(model, optimizer)   # what is really allocated

Modules load on first use (zl.numerics, zl.precision, zl.DDP ...), so `import zerolab`
stays cheap for the worker processes that import it.
"""

import importlib

from . import data, memory, models
from .runtime import comm
from .launch import LaunchError, device, launch, rank, world_size

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself)
_LAZY = {
    "numerics": ("zerolab.theory.numerics", None),
    "precision": ("zerolab.precision", None),
    "collectives": ("zerolab.theory.collectives", None),
    "train": ("zerolab.train", None),
    "single": ("zerolab.engines.single", None),
    "SingleProcess": ("zerolab.engines.single", "SingleProcess"),
    "book": ("zerolab.book", None),
    "engines": ("zerolab.engines", None),
    "checkpoint": ("zerolab.checkpoint", None),
    "mesh": ("zerolab.zero_r.mesh", None),
    "Mesh": ("zerolab.zero_r.mesh", "Mesh"),
    "topology": ("zerolab.topology", None),
    "Topology": ("zerolab.topology", "Topology"),
    "quantize": ("zerolab.quantize", None),
    "tensor_parallel": ("zerolab.zero_r.tensor_parallel", None),
    "activation_checkpointing": ("zerolab.zero_r.activation_checkpointing", None),
    "checkpointing": ("zerolab.checkpointing", None),      # the old name, for one release
    "allocator": ("zerolab.theory.allocator", None),
    "debug": ("zerolab.runtime.debug", None),
    "NaiveDDP": ("zerolab.engines.naive_ddp", "NaiveDDP"),
    "DDP": ("zerolab.engines.ddp", "DDP"),
    "ZeRO": ("zerolab.engines", "ZeRO"),         # zl.ZeRO(model, optimizer, stage=1 | 2 | 3)
    "ZeRO1": ("zerolab.engines.zero1", "ZeRO1"),
    "ZeRO2": ("zerolab.engines.zero2", "ZeRO2"),
    "ZeRO3": ("zerolab.engines.zero3", "ZeRO3"),
    "ShardedOptimizer": ("zerolab.optim.sharded_optimizer", "ShardedOptimizer"),   # ZeRO-1's optimizer half
    "CombinedOptimizer": ("zerolab.optim.combined_optimizer", "CombinedOptimizer"),   # Muon + AdamW as one
    "count_tokens": ("zerolab.token_loss", "count_tokens"), "token_weighted_loss": ("zerolab.token_loss", "token_weighted_loss"),
}


def __getattr__(name):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zerolab' has no attribute {name!r}")


__all__ = ["launch", "LaunchError", "rank", "world_size", "device", "comm", "data", "memory",
           "models", *_LAZY]
