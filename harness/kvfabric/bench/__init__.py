"""Benchmarks of kvfabric (``kvfabric bench NAME``): storage, TTFT, operator."""
