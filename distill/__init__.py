"""distill: knowledge distillation on two device meshes in JAX."""

__version__ = "0.1.0"
