"""Moved to zerolab.optim.whole_matrix (the optimizer's own floor); this name stays for one release."""
from ..optim.whole_matrix import *  # noqa: F401,F403
