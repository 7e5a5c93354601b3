"""What crosses between roles: a batch and a teacher output.

`teacher` and `student` never import each other; both speak these structures. They are
NamedTuples, so they are pytrees that `jax.jit`, `jax.device_put` and Ray pass as-is.
"""

from typing import Any, NamedTuple

Array = Any  # jax.Array or np.ndarray


class Batch(NamedTuple):
    """A packed batch. All fields are [B, S]."""

    tokens: Array  # int32 input token ids
    targets: Array  # int32 next-token ids
    segment_ids: Array  # int32 document id within the row (1, 2, ...); 0 marks padding
    positions: Array  # int32 position within the document (restarts at 0 for each doc)
    mask: Array  # float32 1.0 where the target is a real next token of the same document


class TeacherOutput(NamedTuple):
    """Teacher log-probabilities at the distillation temperature T: log softmax(z / T).

    Dense: `logprobs` is [B, S, V] and `ids` is None.
    Top-k: `logprobs` is [B, S, k] (the k largest, exact, not renormalised) and `ids` is
    [B, S, k] int32 vocabulary ids. The tail mass 1 - sum(exp(logprobs)) is implied.
    """

    logprobs: Array
    ids: Array | None = None
