"""Versioned KVCachePool API types (pydantic models; the CRD is generated from them)."""
