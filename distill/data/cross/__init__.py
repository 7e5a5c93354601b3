"""Rows across tokenizers: the teacher's own tokens of each row's text, aligned to the
student's (`rows`: text; `examples`: conversations and pairs; `samples`: the student's own
samples, on-policy)."""
