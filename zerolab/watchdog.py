"""Moved to zerolab.runtime.watchdog (the runtime's own package); this name stays for one release."""
from .runtime.watchdog import *  # noqa: F401,F403
