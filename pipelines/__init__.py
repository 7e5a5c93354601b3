"""Orchestration of the two meshes, and the shipped YAML pipelines."""
