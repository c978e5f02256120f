"""Contracts between kvfabric's components that neither side may own alone (no dependencies)."""
