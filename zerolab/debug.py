"""Moved to zerolab.runtime.debug (the runtime's own package); this name stays for one release."""
from .runtime.debug import *  # noqa: F401,F403
