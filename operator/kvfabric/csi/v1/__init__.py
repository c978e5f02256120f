"""The vendored CSI v1 and kubelet plugin-registration protocols; ``*_pb2*`` are generated."""
