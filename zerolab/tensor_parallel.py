"""Moved to zerolab.zero_r.tensor_parallel (ZeRO-R's own package); this name stays for one release."""
from .zero_r.tensor_parallel import *  # noqa: F401,F403
