"""The distribution's version (read by hatchling, printed by ``kvfabric version``)."""

__version__ = "0.2.0"
