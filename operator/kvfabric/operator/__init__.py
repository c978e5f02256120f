"""The kvfabric operator: KVCachePool API, reconciler, status and the injection webhook."""
