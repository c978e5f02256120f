"""Wire protocols of kvfabric (generated protobuf/gRPC code lives in versioned subpackages)."""

from typing import Final

CLIENT_ID_HEADER: Final = "kvfabric-client"
"""The metadata key under which a client names itself (the server's per-client slot cap on the Unix
socket, where gRPC shows every peer alike)."""
