"""Version 1 of the cache-server protocol (``kvfabric.rpc.v1``); ``cache_pb2*`` are generated."""
