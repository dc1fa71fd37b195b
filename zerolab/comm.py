"""Moved to zerolab.runtime.comm (the runtime's own package); this name stays for one release."""
from .runtime.comm import *  # noqa: F401,F403
