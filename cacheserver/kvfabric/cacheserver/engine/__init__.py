"""The storage engine: tiers behind one small interface, composed by :class:`TieredStore`.

Nothing here knows about gRPC (an import-linter contract enforces it): the engine is plain threads,
files and memory, so it can be tested and benchmarked without a server.
"""
