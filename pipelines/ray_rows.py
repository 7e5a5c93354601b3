"""Row blocks between the process groups of `pipeline.mode: ray`.

A batch and its teacher output are batch-major, so every hand-off between groups is by
rows. The training mesh splits the rows over its devices in order, and a group's devices
are numbered process by process, so student process `p` of `n` holds the contiguous block
of rows `[p * B / n, (p + 1) * B / n)`: the driver sends it only that block of every batch
(`split_batch`), and every teacher process sends it only the rows of that block which the
teacher process holds (`teacher_parts`), each row by exactly one teacher process (the
lowest-numbered holder when the teacher's output is replicated over some devices). A
student process joins what it receives (`student_rows`) and assembles global arrays from
every process's rows (`global_arrays`). Nothing here goes through the driver but the batch.
"""

from __future__ import annotations

import numpy as np

from distill.types import Batch, TeacherOutput

Piece = tuple[int, TeacherOutput]  # (first global row, host rows of a teacher output)


def split_batch(batch, n: int) -> list:
    """The `n` row blocks of a host batch (or prompts), one per student process, in process
    order."""
    rows = batch.tokens.shape[0] // n
    return [type(batch)(*(f[p * rows : (p + 1) * rows] for f in batch)) for p in range(n)]


def join_batch(parts: list[Batch]) -> Batch:
    """The whole batch from its row blocks (what a teacher process runs on)."""
    if len(parts) == 1:
        return parts[0]
    return Batch(*(np.concatenate(f) for f in zip(*parts, strict=True)))


def _owned_rows(arr) -> dict[tuple[int, int], np.ndarray]:
    """{(start, stop): host rows} of the row blocks of the global array `arr` (rows split
    over its mesh, other axes whole) whose lowest-numbered holder is this process."""
    import jax

    n, me = arr.shape[0], jax.process_index()
    holder: dict[tuple[int, int], int] = {}
    for device, index in arr.sharding.devices_indices_map(arr.shape).items():
        rows = index[0].indices(n)[:2]
        holder[rows] = min(holder.get(rows, device.process_index), device.process_index)
    owned = {}
    for shard in arr.addressable_shards:
        rows = shard.index[0].indices(n)[:2]
        if holder[rows] == me and rows not in owned:
            owned[rows] = np.asarray(shard.data)
    return owned


def teacher_parts(out: TeacherOutput, n: int) -> list[list[Piece]]:
    """For each of `n` student processes, the pieces of its row block that this teacher
    process holds (possibly none): `out` is the teacher's global output."""
    rows = out.logprobs.shape[0] // n
    logprobs = _owned_rows(out.logprobs)
    ids = _owned_rows(out.ids) if out.ids is not None else None
    parts: list[list[Piece]] = [[] for _ in range(n)]
    for (a, b), lp in sorted(logprobs.items()):
        held = TeacherOutput(lp, None if ids is None else ids[(a, b)])
        for p in range(a // rows, (b - 1) // rows + 1):
            lo, hi = max(a, p * rows), min(b, (p + 1) * rows)
            parts[p].append((lo, TeacherOutput(*(_rows(x, lo - a, hi - a) for x in held))))
    return parts


def _rows(x, lo: int, hi: int):
    return None if x is None else x[lo:hi]


def student_rows(parts: list[list[Piece]], first: int, rows: int) -> tuple[TeacherOutput, int]:
    """(this student process's rows `[first, first + rows)` of the teacher output, bytes
    received) from the pieces every teacher process sent it."""
    pieces = sorted((p for part in parts for p in part), key=lambda p: p[0])
    starts = [start for start, _ in pieces]
    sizes = [piece.logprobs.shape[0] for _, piece in pieces]
    expected = list(np.cumsum([first, *sizes[:-1]]))
    if starts != expected or sum(sizes) != rows:
        got = list(zip(starts, sizes, strict=True))
        raise RuntimeError(f"teacher rows (start, n) {got} do not cover {rows} from {first}")
    outs = [piece for _, piece in pieces]
    joined = TeacherOutput(
        np.concatenate([o.logprobs for o in outs]),
        None if outs[0].ids is None else np.concatenate([o.ids for o in outs]),
    )
    return joined, sum(x.nbytes for o in outs for x in o if x is not None)


def local_rows(tree):
    """This process's rows of each leaf of a tree of batch-split global arrays, as host
    arrays (its contiguous block; the whole arrays in a group of one process)."""
    import jax

    def one(arr):
        blocks = sorted(_owned_rows(arr).items())
        return np.concatenate([rows for _, rows in blocks])

    return jax.tree.map(one, tree)


def global_arrays(tree, sharding, rows: int):
    """Global arrays of `rows` rows on `sharding` from this process's block of each leaf."""
    import jax

    def one(x):
        return jax.make_array_from_process_local_data(sharding, x, (rows, *x.shape[1:]))

    return jax.tree.map(one, tree)
