"""ZeRO stage 3: the engine (engine.ZeRO3), its units that gather, release and reduce-scatter
themselves (units.Unit), when they do it (schedule.UnitSchedule), and how their collectives travel
under ZeRO++ and hierarchical sharding (zeropp.Route)."""

from .engine import ZeRO3

__all__ = ["ZeRO3"]
