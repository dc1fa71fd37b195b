"""Moved to zerolab.zero_r.activation_checkpointing (ZeRO-R's own package); this name stays for one release."""
from .zero_r.activation_checkpointing import *  # noqa: F401,F403
