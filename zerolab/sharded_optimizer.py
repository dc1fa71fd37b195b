"""Moved to zerolab.optim.sharded_optimizer (the optimizer's own floor); this name stays for one release."""
from .optim.sharded_optimizer import *  # noqa: F401,F403
