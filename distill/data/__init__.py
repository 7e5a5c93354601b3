"""Data: documents read by Grain, tokenizers, packing into rows, prepared corpora, prompts."""
