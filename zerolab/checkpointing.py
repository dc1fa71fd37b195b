"""The old name of zerolab.zero_r.activation_checkpointing (activation checkpointing and ZeRO-R's
partitioned checkpoints), kept for one release beside zerolab.checkpoint (sharded training state),
with which it was easy to confuse. Import zerolab.zero_r.activation_checkpointing instead."""

import warnings

from .zero_r.activation_checkpointing import ActivationCheckpointing, disable, enable  # noqa: F401

warnings.warn("zerolab.checkpointing is now zerolab.zero_r.activation_checkpointing (zl.activation_checkpointing); "
              "the old name goes in the next release", DeprecationWarning, stacklevel=2)
