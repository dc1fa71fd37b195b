"""Sharded checkpoints: save, load (at any world size or stage), consolidate.

    zl.checkpoint.save(engine, "ckpt/", extra={"data_step": 3})   # every rank calls it
    zl.checkpoint.load(engine, "ckpt/")                            # -> the `extra` dict
    state = zl.checkpoint.consolidate("ckpt/")                     # no process group needed

A checkpoint is a directory:

    metadata.json                  the layout: every parameter's name, shape, and which file
                                   holds which element range of it, each file's size and
                                   SHA-256, and at its end its own SHA-256 over the bytes
                                   before it (checked before parsing); written LAST
    shard-<id>-00000-of-00002.pt   what rank 0 owns: for each piece (parameter name, lo, hi)
                                   its fp32 master values and optimizer state; rank 0's file
                                   also holds the buffers; every file holds its rank's step
                                   count, loss scaler, RNG states and your `extra`
    shard-<id>-00000-unit3.master.bin ...   offload="disk" only: the engine's own files, linked
                                   (zerolab.engines.offload.disk): the .pt file then says where
                                   each piece's values and state are in them instead of
                                   holding them, so saving and loading never hold the model

The unit of the layout is the PIECE: elements [lo, hi) of one parameter, flattened. No rank
ever gathers the full model to save: ZeRO ranks write the pieces of their own flat shard, and
engines whose ranks hold the same replica (SingleProcess, DDP) split each parameter N ways so
each rank writes 1/N of it. Loading reads, for each element range the new engine owns, the
pieces that overlap it, so a checkpoint saved by ZeRO-3 on 2 ranks loads into ZeRO-2 on 4 from
the metadata alone.

Nothing is ever lost by a crash mid-save: shards are written under fresh names (a new <id> per
save) into temporary files created exclusively (a link planted at the name is not followed) and
renamed, and metadata.json (which names the shards to use) is replaced atomically only after every
rank has written its shard. Until that rename the old metadata still points at the old, untouched
shards. Old shards are removed after it. A save that fails on one rank fails on every rank, and
each removes the files it wrote (zerolab.checkpoint.atomic: a rank stopped with SIGTERM too).

Every rank of the engine loads the same checkpoint: load compares its step and digest across the
engine's ranks before anything else, and refuses on every rank, naming each rank's directory and
step, if they differ. Loading never runs code (reader): shards are read with
torch.load(weights_only=True) and the metadata is JSON. The metadata's digest covers the shards'
sizes and SHA-256s, so a changed byte anywhere is found; only regular files inside the directory
are read, each with a bound, and what a crafted file could make the reader build is bounded too
(files: the metadata's size and number of values; reader: what a shard's zip may inflate to; extra
at most 16 MiB of tensors and 1 MiB of other values). A missing, truncated, corrupt or crafted
file, a model or optimizer that does not match, a hyperparameter out of range raise
CheckpointError naming the file that holds what is wrong, before anything in the engine has
changed on any rank (validate).

A torch.distributed.checkpoint (DCP) directory is the other format: save(..., format="dcp")
writes one (FSDP2 loads it), load and consolidate read one, FSDP2's and torchtitan's included
(dcp). The same promises hold for it: nothing in it runs code (unpickle), the one zerolab writes
carries a sealed manifest of its files' digests and is put in place whole (dcp_reader, atomic),
and the ranks agree on it (ranks). A directory never holds both formats: load refuses one that
does, naming both, and a save refuses to write one format where the other is unless
replace=True (files.format_of, check_other_format).

The package: api (save, load, consolidate, describe), writer (how a save writes and publishes),
atomic (how any file is written: exclusively, then renamed; a directory replaced whole; clean-up
when stopped), files (the files themselves: regular, bounded, sealed; which format a directory
holds), reader (a checkpoint read and verified), validate (does it fit this engine), ranks (what
the ranks agree on), dcp (DCP directories), dcp_reader (one read and verified), unpickle (the
allow-lists DCP's pickles are read with).
"""

from .api import consolidate, describe, load, save
from .files import METADATA, CheckpointError

__all__ = ["CheckpointError", "METADATA", "consolidate", "describe", "load", "save"]
