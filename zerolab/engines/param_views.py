"""Moved to zerolab.optim.param_views (the optimizer's own floor); this name stays for one release."""
from ..optim.param_views import *  # noqa: F401,F403
