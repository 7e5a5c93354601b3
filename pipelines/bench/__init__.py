"""`distill bench`: each phase alone, the pipelined loop, one role alone, on-policy, and the
same step in PyTorch for comparison. Benchmarks, apart from the product's loop."""
