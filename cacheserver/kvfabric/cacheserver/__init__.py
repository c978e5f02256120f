"""The per-node KV-chunk cache server: tiered storage (DRAM, local disk, shared volume) behind gRPC."""
