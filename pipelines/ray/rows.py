"""Row blocks between the process groups of `pipeline.mode: ray`, and the rows each process
reads for itself.

Data per host: the corpus is deterministic and addressable by batch index
(`distill.data.corpus.Corpus.train_dataset`), so the driver sends every process only the step's
data state, `{"next_index": n}` (its iterator state before batch n), and each process reads
the rows of global batch n it needs from its own copy of the corpus (`BatchReader`; with
`data.prepared_dir`, from disk on demand). The data state is the same for every process of
both groups, so the one state the student checkpoints is every process's data position.

A batch and its teacher output are batch-major, so every hand-off between groups is by
rows. The training mesh splits a batch's rows into equal shards over its devices, and
`row_owners` says which student process holds each shard, in row order: the student's
layout decides (`distill.mesh.device_grid`: host by host, so each process holds one
contiguous block, or, on one TPU slice, slice-wide, so a process's rows may be several
blocks). Every helper here follows those owners, so any layout works. A student process
reads only its rows (`spans`), and every teacher process sends it only those of its rows
which the teacher process holds (`teacher_parts`), each row by exactly one teacher process
(the lowest-numbered holder when the teacher's output is replicated over some devices). A
teacher process reads the rows its devices hold (`global_batch`; across tokenizers the
teacher's own rows and the alignment, so that for a student with `cp` its outputs leave
already at the student's positions, `teacher.positions`). A student process joins
what it receives (`student_rows`) and assembles global arrays from every process's rows
(`global_arrays`: a process's rows concatenated in row order, as
`jax.make_array_from_process_local_data` maps them). With context parallelism
(`mesh.<role>.cp`) the teacher's outputs are split by position too: a teacher process
sends blocks of rows x positions, never whole rows it does not hold, and a student
process, which holds all the cp devices of its rows, writes them into its rows, each of
its devices then taking its positions. On-policy rows are made by the student processes
and sent to the teacher group, which puts them back in row order (`join_batch`). Nothing
here goes through the driver.
"""

from __future__ import annotations

import hashlib

import numpy as np

from distill.data.corpus import Corpus
from distill.errors import DistillError
from distill.handoff import Block, blocks
from distill.types import Batch, TeacherOutput

# ((first global row, first position), host rows x positions of a teacher output)
Piece = tuple[tuple[int, int], TeacherOutput]
Owners = tuple[int, ...]  # the student process holding each row shard of a batch, in order
Spans = list[tuple[int, int]]  # [lo, hi) blocks of a batch's rows, in order


class BatchReader:
    """Rows of the run's global batches by data state: what `Corpus.train_iterator` would
    yield after `set_state(state)`, any block of its rows, read without the others."""

    def __init__(self, corpus: Corpus, batch_size: int, seed: int):
        self._corpus, self.batch_size, self.seq_len = corpus, batch_size, corpus.train.seq_len
        self._ids = corpus.train_row_ids(batch_size, seed)  # batch n's row ids
        self.train_rows = corpus.train_rows
        self.cross = corpus.teacher is not None  # rows with the teacher's own tokens (a view)

    def rows(self, data_state: dict, spans: Spans | None = None) -> Batch:
        """The rows in `spans` (default: all) of the batch at `data_state`, in order."""
        ids = self._ids[data_state["next_index"]]
        return self._corpus.train.gather(ids if spans is None else take(ids, spans))


def data_check(reader: BatchReader) -> str:
    """A short identity of the rows a process reads: its train rows and a checksum of its
    first batch. Every process of both groups must read the driver's rows (the same files
    mounted on every host): the driver compares them."""
    first = reader.rows({"next_index": 0})
    digest = hashlib.sha256(first.tokens.tobytes() + first.mask.tobytes()).hexdigest()
    return f"{reader.train_rows} rows, batch 0 {digest[:12]}"


def row_owners(sharding) -> Owners:
    """For each row shard of a batch split by `sharding` (the student's batch sharding, its
    rows and with `cp` their positions), in row order, the process whose devices hold it
    (the lowest-numbered when several do). A row's cp devices must be one process's
    (`distill.mesh` checks the hosts; a TPU slice's torus could still interleave them)."""
    n = sharding.num_devices  # a multiple of the shard count: equal shards
    holder: dict[tuple[int, int], int] = {}
    positions: dict[tuple[int, int], set[int]] = {}  # row shard -> processes of its positions
    for device, index in sharding.devices_indices_map((n, n)).items():
        rows, p = index[0].indices(n)[:2], device.process_index
        holder[rows] = min(holder.get(rows, p), p)
        if index[1].indices(n)[:2] != (0, n):
            positions.setdefault(rows, set()).add(p)
    if any(len(ps) > 1 for ps in positions.values()):
        raise DistillError(
            "mesh.student.cp: the training mesh splits a row's positions over several "
            "processes; in pipeline.mode ray a row's cp devices must be one process's"
        )
    return tuple(p for _, p in sorted(holder.items()))


def spans(owners: Owners, p: int, rows: int) -> Spans:
    """The rows of a batch of `rows` that student process `p` holds, as blocks in order
    (adjacent shards merged: one block when the layout is host by host)."""
    size = rows // len(owners)
    return _merged([(k * size, (k + 1) * size) for k, q in enumerate(owners) if q == p])


def take(x, spans: Spans):
    """The rows of `x` in `spans`, in order."""
    if len(spans) == 1:
        return x[spans[0][0] : spans[0][1]]
    return np.concatenate([x[lo:hi] for lo, hi in spans])


def global_batch(reader: BatchReader, data_state: dict, sharding) -> Batch:
    """The batch at `data_state` as global arrays on `sharding` (rows split over some of its
    axes), this process reading only the rows its own devices hold. Across tokenizers, only
    what the teacher reads: a Batch whose `teacher` view holds the teacher's own rows of the
    text [B, T] on `sharding` and the alignment [B, S] where the outputs lie
    (`teacher.positions.align_sharding`, for `OnlineTeacher.output` to gather the outputs at
    the student's positions when the student has `cp`); its student fields are None."""
    import jax

    from teacher.positions import align_sharding

    rows = reader.batch_size
    aligned = align_sharding(sharding.mesh, rows) if reader.cross else None
    mine = np.zeros(rows, bool)  # the rows this process's devices hold, in either layout
    for where in (sharding, aligned) if reader.cross else (sharding,):
        for idx in where.addressable_devices_indices_map((rows, reader.seq_len)).values():
            mine[slice(*idx[0].indices(rows)[:2])] = True
    local = reader.rows(data_state, _runs(mine))
    at = np.cumsum(mine) - 1  # a held row -> where it is in `local`

    def one(x, where=sharding):
        def piece(index):  # a device's rows (and with `cp` its positions of them)
            a, b = index[0].indices(rows)[:2]
            return x[at[a] : at[a] + b - a][(slice(None), *index[1:])]

        return jax.make_array_from_callback((rows, *x.shape[1:]), where, piece)

    def placed(batch: Batch) -> Batch:
        return Batch(*(None if x is None else one(x) for x in batch))

    if local.teacher is None:
        return placed(local)
    view = local.teacher
    return Batch(*[None] * 5, type(view)(placed(view.rows), one(view.align, aligned)))


def _runs(held: np.ndarray) -> Spans:
    """The [lo, hi) runs of True in `held`, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], held.astype(np.int8), [0]])))
    return [(int(lo), int(hi)) for lo, hi in zip(edges[::2], edges[1::2], strict=True)]


def _merged(blocks: Spans) -> Spans:
    out: Spans = []
    for lo, hi in sorted(blocks):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def split_batch(batch, owners: Owners) -> list:
    """Each student process's rows of a host batch (or prompts), in process order."""
    rows = batch.tokens.shape[0]
    return [
        type(batch)(*(None if f is None else take(f, spans(owners, p, rows)) for f in batch))
        for p in range(max(owners) + 1)
    ]


def join_batch(parts: list[Batch], owners: Owners) -> Batch:
    """The whole batch from each student process's rows (what a teacher process runs on)."""
    if len(parts) == 1:
        return parts[0]
    rows = sum(part.tokens.shape[0] for part in parts)

    def join(*fields):
        out = np.empty((rows, *fields[0].shape[1:]), fields[0].dtype)
        for p, f in enumerate(fields):
            at = 0
            for lo, hi in spans(owners, p, rows):
                out[lo:hi], at = f[at : at + hi - lo], at + hi - lo
        return out

    import jax

    return jax.tree.map(join, *parts)  # the teacher's rows too, on-policy across tokenizers


def _owned_blocks(arr) -> dict[Block, np.ndarray]:
    """{(rows, positions): host block} of the blocks of the global array `arr` (rows split
    over its mesh, with `cp` their positions too, other axes whole; `distill.handoff.blocks`)
    whose lowest-numbered holder is this process."""
    import jax

    me = jax.process_index()
    holder: dict[Block, int] = {}
    for device, index in arr.sharding.devices_indices_map(arr.shape).items():
        block = blocks(index, arr.shape)
        holder[block] = min(holder.get(block, device.process_index), device.process_index)
    owned = {}
    for shard in arr.addressable_shards:
        block = blocks(shard.index, arr.shape)
        if holder[block] == me and block not in owned:
            owned[block] = np.asarray(shard.data)
    return owned


def teacher_parts(out: TeacherOutput, owners: Owners) -> list[list[Piece]]:
    """For each student process (`owners`: `row_owners` of the student's layout), the
    pieces of its rows that this teacher process holds (possibly none): `out` is the
    teacher's global output. With the teacher's `cp` a piece is a block of rows x
    positions, never gathered into whole rows here."""
    size = out.logprobs.shape[0] // len(owners)
    logprobs = _owned_blocks(out.logprobs)
    ids = _owned_blocks(out.ids) if out.ids is not None else None
    parts: list[list[Piece]] = [[] for _ in range(max(owners) + 1)]
    for ((a, b), (c, d)), lp in sorted(logprobs.items()):
        held = TeacherOutput(lp, None if ids is None else ids[(a, b), (c, d)])
        for k in range(a // size, (b - 1) // size + 1):
            lo, hi = max(a, k * size), min(b, (k + 1) * size)
            piece = TeacherOutput(*(_rows(x, lo - a, hi - a) for x in held))
            parts[owners[k]].append(((lo, c), piece))
    return parts


def window_parts(windows: tuple, owners: Owners) -> list[tuple[list[Piece], ...]]:
    """`teacher_parts` of eval logits in position windows (`pipelines.evaluation
    .eval_windows`): for each student process a tuple, one list of its pieces per window."""
    per = [teacher_parts(TeacherOutput(w, None), owners) for w in windows]
    return [tuple(p[s] for p in per) for s in range(len(per[0]))]


def is_windowed(teacher_parts: tuple) -> bool:
    """Whether the parts every teacher process sent are `window_parts`."""
    first = teacher_parts[0] if teacher_parts else None
    return isinstance(first, tuple) and bool(first) and isinstance(first[0], list)


def student_window_rows(parts: list[tuple], mine: Spans) -> tuple[tuple, int]:
    """(this student process's rows `mine` of each window, in order; bytes received) from
    the `window_parts` every teacher process sent it."""
    got = [student_rows([p[j] for p in parts], mine) for j in range(len(parts[0]))]
    return tuple(out.logprobs for out, _ in got), sum(n for _, n in got)


def _rows(x, lo: int, hi: int):
    return None if x is None else x[lo:hi]


def student_rows(parts: list[list[Piece]], mine: Spans) -> tuple[TeacherOutput, int]:
    """(this student process's rows `mine` of the teacher output, in order, all their
    positions; bytes received) from the pieces every teacher process sent it (rows x
    positions blocks), each written once into place."""
    pieces = [p for part in parts for p in part]
    got = [(at, piece.logprobs.shape[:2]) for at, piece in pieces]
    where, start = [], 0  # each piece's (index, row here, position, rows, positions)
    for lo, hi in mine:
        for i, ((r, c), (n, w)) in enumerate(got):
            if lo <= r < hi:
                if r + n > hi:
                    raise RuntimeError(f"teacher rows (start, shape) {got} split the rows {mine}")
                where.append((i, start + r - lo, c, n, w))
        start += hi - lo
    width = max((c + w for *_, c, _, w in where), default=0)
    covered = np.zeros((start, width), np.int32)
    for _, r, c, n, w in where:
        covered[r : r + n, c : c + w] += 1
    if not width or len(where) != len(pieces) or (covered != 1).any():
        raise RuntimeError(f"teacher rows (start, shape) {got} do not cover the rows {mine}")

    def joined(field: str):
        first = getattr(pieces[0][1], field)
        if first is None:
            return None
        out = np.empty((start, width, *first.shape[2:]), first.dtype)
        for i, r, c, n, w in where:
            out[r : r + n, c : c + w] = getattr(pieces[i][1], field)
        return out

    nbytes = sum(x.nbytes for _, piece in pieces for x in piece if x is not None)
    return TeacherOutput(joined("logprobs"), joined("ids")), nbytes


def local_rows(tree):
    """This process's rows of each leaf of a tree of row-split global arrays (whole rows on
    each device), as host arrays (its row shards in row order; the whole arrays in a group
    of one process)."""
    import jax

    def one(arr):
        return np.concatenate([rows for _, rows in sorted(_owned_blocks(arr).items())])

    return jax.tree.map(one, tree)


def global_arrays(tree, sharding, rows: int):
    """Global arrays of `rows` rows on `sharding` from this process's rows of each leaf
    (its row shards in row order, as `local_rows` and `take` give them)."""
    import jax

    def one(x):
        return jax.make_array_from_process_local_data(sharding, x, (rows, *x.shape[1:]))

    return jax.tree.map(one, tree)
