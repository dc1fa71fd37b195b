"""The functions the GPU runs' ranks run (launched ranks import them from here: gpu.workers), one
module per thing measured:

    parity          every engine against one process; which collectives run on CUDA tensors
    bench           step time, held and peak memory of every engine (zerolab's, PyTorch's, DeepSpeed's)
    memsnap         the CUDA allocator over ZeRO-3 steps, and chapter 9's allocator model
    profile_steps   each engine's kernels in a profiled step
    offload         ZeRO-R's activation options; the PCIe copy rates
    overlap         chapter 5's three DDPs and chapter 8's prefetch, from the ledger
    engines         what they build: zerolab's engines, PyTorch's peers, DeepSpeed

Every function runs on each rank under zl.launch and returns plain Python / CPU tensors.
On a machine without a GPU they fall back to the CPU, so the scripts can be tried anywhere.
What each rank runs on (compute_device, bench_cfg, token_batch) is gpu.common's.
"""

from gpu.common import bench_cfg, compute_device
from gpu.workers.bench import BENCH_ENGINES, bench_worker
from gpu.workers.engines import OPT, make_engine
from gpu.workers.memsnap import memsnap_worker
from gpu.workers.offload import OFFLOAD_CONFIGS, offload_worker, pcie_bandwidth
from gpu.workers.overlap import ddp_overlap_worker, prefetch_worker
from gpu.workers.parity import ENGINES, STEPS, collectives_probe, parity_worker, reference_state
from gpu.workers.profile_steps import profile_worker

__all__ = ["BENCH_ENGINES", "ENGINES", "OFFLOAD_CONFIGS", "OPT", "STEPS", "bench_cfg", "bench_worker",
           "collectives_probe", "compute_device", "ddp_overlap_worker", "make_engine", "memsnap_worker",
           "offload_worker", "parity_worker", "pcie_bandwidth", "prefetch_worker", "profile_worker",
           "reference_state"]
