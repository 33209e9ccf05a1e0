"""Speculative and autoregressive decoding: sampling, verification, KV caches, the loop, its speed model."""
