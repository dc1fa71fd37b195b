"""Imported only by zl.launch's fork server (its preload list): see zerolab.launch_startup."""

from .launch_startup import install

install()
