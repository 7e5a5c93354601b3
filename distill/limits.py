"""The largest array a program may make: a bound every role's compiled programs keep.

XLA's own fused kernels index large arrays with 64-bit offsets, but sorts (CUB's segmented
radix sort on GPUs, whose row offsets are 32-bit) and custom kernels may not: an array of
2^31 elements or more, or a sort over one, can fault on a GPU (`CUDA_ERROR_ILLEGAL_ADDRESS`
at 8 rows x 4,096 tokens x 128,256 ids, issue 32). So no array ending in the vocabulary is
ever made whole at that size: the vocabulary-wide computations run over chunks of rows or
positions, and a dense teacher output too large for one array per device is handed over in
row blocks, one per `train.grad_accum` microbatch (`distill.handoff.dense_blocks`), or
refused in `distill validate` where blocks cannot bound it (`check_dense_elements`).
Checked on the compiled programs by tests/test_vocab_bound.py.
"""

from __future__ import annotations

import math

# Elements of one array, exclusive: a signed 32-bit index reaches 2^31 - 1.
MAX_ELEMENTS = 2**31


def fits(shape) -> bool:
    """Whether an array of `shape` stays under MAX_ELEMENTS."""
    return math.prod(shape) < MAX_ELEMENTS


def rows_that_fit(*row_shape: int) -> int:
    """How many rows of `row_shape` (e.g. S, V) one array holds under MAX_ELEMENTS."""
    return (MAX_ELEMENTS - 1) // max(math.prod(row_shape), 1)
