"""Moved to zerolab.optim.param_groups (the optimizer's own floor); this name stays for one release."""
from ..optim.param_groups import *  # noqa: F401,F403
