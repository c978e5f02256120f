"""How bytes reach the server besides gRPC messages: same-node shared-memory staging (``arena``).

The transport layer sits between the gRPC service and the storage engine (the import-linter
layers contract ``server > service > transport > engine``): it may use the engine, never the service.
"""
