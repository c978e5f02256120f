"""A small torch reference engine (Llama-style decoder with a paged KV cache) that drives the connector.

It exists to prove, on a CPU, that loading cached KV gives the same logits as recomputing it, to
measure TTFT with and without the cache, and to act as the "inference pod" in end-to-end tests.
"""
