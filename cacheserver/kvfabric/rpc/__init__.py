"""Wire protocols of kvfabric (generated protobuf/gRPC code lives in versioned subpackages)."""
