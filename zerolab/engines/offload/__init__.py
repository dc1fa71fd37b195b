"""Model states off the accelerator: ZeRO-Offload's host masters and optimizer (optimizer.
OptimizerOffload, any stage) and ZeRO-Infinity's files (disk.ZeRO3Disk, stage 3, through pager.Pager)."""

from .disk import ZeRO3Disk
from .optimizer import OptimizerOffload, Transfers, host_empty

__all__ = ["OptimizerOffload", "Transfers", "ZeRO3Disk", "host_empty"]
