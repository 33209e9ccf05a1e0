"""Adaptive routing: per-prompt drafter labels, the router, routed generation."""
