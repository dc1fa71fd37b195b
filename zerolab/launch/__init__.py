"""zl.launch: real worker processes with torch.distributed initialised, and what comes back.

    parent      zl.launch itself: check, start the ranks, wait, stop them all (rank, world_size, device;
                process_context: where ranks come from, for a queue the parent and rank 0 share)
    worker      one rank: set up its process group, run fn, send back what it returns
    results     the parent side of the ranks' values and failures: LaunchError
    output      what the ranks print: rank 0's live, the others' at the end, bounded
    startup     what a rank that fails while starting leaves behind for the parent to read
    startup_hook    imported by the fork server: ranks end with their launcher
    tempdir     each launcher's private directory, and the sweep of the ones whose launcher is gone
    in_place    under torchrun (or in a process group made by hand): fn runs in this process
"""

from .parent import device, launch, process_context, rank, world_size
from .results import LaunchError

__all__ = ["LaunchError", "device", "launch", "process_context", "rank", "world_size"]
