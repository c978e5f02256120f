"""Test helpers of the development harness: never imported by the product.

- :mod:`kvfabric.testing.serverproc`: real cache-server processes on temporary directories.
- :mod:`kvfabric.testing.memtransport`: an in-memory transport with the client's interface and
  injectable faults, for fast unit tests of the connector.
- :mod:`kvfabric.testing.levels`: the pytest plugin that gives every test its level of the test ladder.
"""
