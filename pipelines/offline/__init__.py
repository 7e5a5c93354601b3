"""Offline distillation: `distill cache-teacher` writes the teacher's top-k outputs once; runs
with `teacher.source: cache` train from them with no teacher on any device."""
