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
    teacher: Any = None  # TeacherView: the teacher's own tokens of the same text, or None
    route: Any = None  # [B, S] int32 teacher of each position (data.teacher_field), or None


class TeacherView(NamedTuple):
    """The teacher's side of a cross-tokenizer row (`distill.data.cross.rows`): its own tokens
    of exactly the row's text, and where each student position's prefix ends among them."""

    rows: Batch  # [B, T] the teacher's packed rows (its own row length T)
    align: Array  # [B, S] int32 teacher position whose prefix ends where the student's does; -1


class Continuations(Batch):
    """Rows of prompts and the student's own continuations (on-policy distillation,
    `distill.models.decode.continuation_batch`): `mask` marks the generated targets, and the
    student's loss on them is the divergence alone (no cross-entropy on its own samples).
    A distinct pytree type, so a step compiled for it is compiled once, beside the one for
    the data's rows."""

    __slots__ = ()


class TeacherOutput(NamedTuple):
    """Teacher log-probabilities at the distillation temperature T: log softmax(z / T).

    Dense: `logprobs` is [B, S, V] and `ids` is None; or, where one such array per device
    would reach `distill.limits.MAX_ELEMENTS`, a tuple of n blocks [B/n, S, V], block j the
    rows j, j + n, ... (`train.grad_accum` microbatch j's: `distill.handoff.dense_blocks`).
    Top-k: `logprobs` is [B, S, k] (the k largest, exact, not renormalised) and `ids` is
    [B, S, k] int32 vocabulary ids. The tail mass 1 - sum(exp(logprobs)) is implied.
    """

    logprobs: Array
    ids: Array | None = None


class TeacherMix(NamedTuple):
    """Several teachers' outputs for one batch (`teachers:`): `outputs` a TeacherOutput
    each, `weights` [B, S, n] float32 each position's weight of each teacher (summing to 1:
    one-hot of the batch's `route` when records are routed, the teachers' mixture weights
    otherwise). The divergence is their weighted sum (`distill.models.vocab_loss`)."""

    outputs: tuple
    weights: Array


class Prompts(NamedTuple):
    """Prompts to continue, [B, P] each, laid out as packed rows (`distill.models.decode`): the
    continuation extends each row's last document; rows shorter than P are left-padded
    with segment id 0."""

    tokens: Array  # int32
    segment_ids: Array  # int32; 0 marks padding
    positions: Array  # int32 position within the document
