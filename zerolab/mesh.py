"""Moved to zerolab.zero_r.mesh (ZeRO-R's own package); this name stays for one release."""
from .zero_r.mesh import *  # noqa: F401,F403
