"""Attention kernels in plain JAX: blockwise (flash-style, any backend), ring (context
parallel)."""
