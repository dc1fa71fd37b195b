"""Moved to zerolab.optim.combined_optimizer (the optimizer's own floor); this name stays for one release."""
from .optim.combined_optimizer import *  # noqa: F401,F403
