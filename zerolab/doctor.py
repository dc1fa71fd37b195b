"""Moved to zerolab.runtime.doctor (the runtime's own package); this name stays for one release."""
from .runtime.doctor import *  # noqa: F401,F403
