"""The distribution's version (read by hatchling, printed by ``kvfabric version``)."""

__version__ = "0.1.0"
