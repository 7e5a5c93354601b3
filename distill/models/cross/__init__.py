"""Cross-tokenizer distillation: a teacher and a student with different tokenizers compared
on the text they share (`losses`), and a top-k teacher's outputs through buckets (`topk`)."""
