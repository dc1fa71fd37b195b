"""Moved to zerolab.runtime.recorder (the runtime's own package); this name stays for one release."""
from .runtime.recorder import *  # noqa: F401,F403
