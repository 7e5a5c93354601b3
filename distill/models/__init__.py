"""The model: one decoder for every family and both roles, its attention kernels, the chunked
vocabulary losses, decoding with a KV cache, and the Hugging Face format on disk."""
