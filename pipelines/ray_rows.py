"""Row blocks between the process groups of `pipeline.mode: ray`, and the rows each process
reads for itself.

Data per host: the corpus is deterministic and addressable by batch index
(`distill.corpus.Corpus.train_dataset`), so the driver sends every process only the step's
data state, `{"next_index": n}` (its iterator state before batch n), and each process reads
the rows of global batch n it needs from its own copy of the corpus (`BatchReader`; with
`data.prepared_dir`, from disk on demand). The data state is the same for every process of
both groups, so the one state the student checkpoints is every process's data position.

A batch and its teacher output are batch-major, so every hand-off between groups is by
rows. The training mesh splits the rows over its devices in order, and a group's mesh
holds each process's devices consecutively, in process order (`distill.mesh.device_grid`),
so student process `p` of `n` holds the contiguous block
of rows `[p * B / n, (p + 1) * B / n)` (`block`): it reads only those rows, and every
teacher process sends it only the rows of that block which the teacher process holds
(`teacher_parts`), each row by exactly one teacher process (the lowest-numbered holder when
the teacher's output is replicated over some devices). A teacher process reads the rows its
devices hold (`global_batch`). A student process joins what it receives (`student_rows`)
and assembles global arrays from every process's rows (`global_arrays`). On-policy rows
are made by the student processes and sent to the teacher group as row blocks
(`join_batch`). Nothing here goes through the driver.
"""

from __future__ import annotations

import hashlib

import numpy as np

from distill.corpus import Corpus
from distill.types import Batch, TeacherOutput

Piece = tuple[int, TeacherOutput]  # (first global row, host rows of a teacher output)


class BatchReader:
    """Rows of the run's global batches by data state: what `Corpus.train_iterator` would
    yield after `set_state(state)`, any block of its rows, read without the others."""

    def __init__(self, corpus: Corpus, batch_size: int, seed: int):
        self._corpus, self.batch_size, self.seq_len = corpus, batch_size, corpus.train.seq_len
        self._ids = corpus.train_row_ids(batch_size, seed)  # batch n's row ids
        self.train_rows = corpus.train_rows

    def rows(self, data_state: dict, lo: int = 0, hi: int | None = None) -> Batch:
        """Rows `[lo, hi)` (default: all) of the batch at `data_state`, [hi - lo, S] each."""
        ids = self._ids[data_state["next_index"]]
        return self._corpus.train.gather(ids[lo : self.batch_size if hi is None else hi])


def data_check(reader: BatchReader) -> str:
    """A short identity of the rows a process reads: its train rows and a checksum of its
    first batch. Every process of both groups must read the driver's rows (the same files
    mounted on every host): the driver compares them."""
    first = reader.rows({"next_index": 0})
    digest = hashlib.sha256(first.tokens.tobytes() + first.mask.tobytes()).hexdigest()
    return f"{reader.train_rows} rows, batch 0 {digest[:12]}"


def block(batch_size: int, n: int, p: int) -> tuple[int, int]:
    """The rows `[lo, hi)` of a global batch that student process `p` of `n` holds."""
    rows = batch_size // n
    return p * rows, (p + 1) * rows


def global_batch(reader: BatchReader, data_state: dict, sharding) -> Batch:
    """The batch at `data_state` as global arrays on `sharding` (rows split over some of its
    axes), this process reading only the rows its own devices hold."""
    import jax

    shape = (reader.batch_size, reader.seq_len)
    spans = [
        idx[0].indices(shape[0])[:2]
        for idx in sharding.addressable_devices_indices_map(shape).values()
    ]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    local = reader.rows(data_state, lo, hi)

    def one(x):
        def piece(index):
            a, b = index[0].indices(shape[0])[:2]
            return x[a - lo : b - lo]

        return jax.make_array_from_callback(shape, sharding, piece)

    return Batch(*(one(x) for x in local))


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
