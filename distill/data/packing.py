"""Whole conversations packed best-fit into rows, each token flagged for the loss.

Text is packed concat-then-split (``distill.data.corpus.PackedRows``): documents run on
across rows. A conversation (or prompt/completion pair) is instead kept whole in one row,
so its answers are always seen after their question: each row holds S+1 token slots (the
inputs and, shifted by one, the targets), conversations are placed longest first into the
fullest row that still has room (best-fit decreasing), and the slots left over are padding
(segment id 0, no loss). A conversation longer than S+1 tokens is cut to S+1, or split into
overlapping windows of S+1 (one token shared, as text rows share it), as
``data.long_conversations`` says.

Each slot carries three flags beside its token id: ``starts`` (a conversation's first
token), ``train`` (the loss counts predicting this token: the assistant's tokens, see
``distill.data.chat``) and ``real`` (not padding). The Batch of a row derives from them:
``mask[j] = train[j+1]`` on the same conversation, ``segment_ids`` 0 on padding.
"""

from __future__ import annotations

import bisect

import numpy as np

from distill.data.corpus import row_at, rows_batch
from distill.types import Batch


def fit_pieces(
    trains: list[np.ndarray], seq_len: int, split_long: bool
) -> tuple[list[tuple[int, int, int]], int]:
    """The pieces (example, first token, end token) of examples with train flags ``trains``
    ([n] bool each) that fit a row of S+1 slots: a whole example, the first S+1 tokens of a
    longer one, or windows of S+1 overlapping by one token; a cut or window with no token to
    learn is left out. Returns them and how many examples were longer than a row."""
    cap = seq_len + 1
    out, long = [], 0
    for i, train in enumerate(trains):
        n = len(train)
        if n <= cap:
            out.append((i, 0, n))
            continue
        long += 1
        if not split_long:
            if train[1:cap].any():  # a cut that kept nothing to learn is left out
                out.append((i, 0, cap))
            continue
        for lo in range(0, n - 1, seq_len):
            hi = min(lo + cap, n)
            if train[lo + 1 : hi].any():  # a window with nothing to learn is left out
                out.append((i, lo, hi))
    return out, long


def fit_examples(
    examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, split_long: bool
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """Examples (ids [n], train [n] bool) that fit a row of S+1 slots (``fit_pieces``), and
    how many were longer than a row."""
    pieces, long = fit_pieces([train for _, train in examples], seq_len, split_long)
    return [(examples[i][0][lo:hi], examples[i][1][lo:hi]) for i, lo, hi in pieces], long


def best_fit(lengths: np.ndarray, cap: int) -> list[list[int]]:
    """Rows of example indices: longest first, each into the row with the least room that
    still holds it, a new row when none does (ties go to the earliest such row)."""
    rows: list[list[int]] = []
    room: dict[int, list[int]] = {}  # free slots -> rows with that many, oldest last
    sizes: list[int] = []  # the sorted keys of `room`
    for i in np.lexsort((np.arange(len(lengths)), -np.asarray(lengths))):
        n = int(lengths[i])
        k = bisect.bisect_left(sizes, n)
        if k == len(sizes):
            row, free = len(rows), cap
            rows.append([])
        else:
            free = sizes[k]
            row = room[free].pop()
            if not room[free]:
                del room[free]
                sizes.pop(k)
        rows[row].append(int(i))
        left = free - n
        if left > 0:
            if left not in room:
                bisect.insort(sizes, left)
                room[left] = []
            room[left].insert(0, row)
    return rows


class ExampleRows:
    """Rows of whole examples, with ``len``, ``gather`` and ``windows`` as ``PackedRows``.

    Holds ids [R, S+1] int32 and the flags [R, S+1] bool ``starts``, ``train``, ``real``.
    """

    planes = 3  # flag planes per row beside the ids (prepared records store them all)

    def __init__(self, ids, starts, train, real, num_documents: int, num_long: int = 0):
        self.ids, self.starts, self.train, self.real = ids, starts, train, real
        self.seq_len = ids.shape[1] - 1
        self.num_tokens = int(real.sum())
        self.num_documents = num_documents
        self.num_long = num_long
        self.stream = ids.reshape(-1)  # what `distill.identity.data_hash` reads

    @classmethod
    def pack(
        cls, examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, split_long: bool
    ) -> ExampleRows:
        """Pack ``examples`` (ids [n] int32, train [n] bool) into rows of ``seq_len``."""
        fitted, num_long = fit_examples(examples, seq_len, split_long)
        rows = best_fit(np.array([len(ids) for ids, _ in fitted], np.int64), seq_len + 1)
        ids, train, starts, real = lay_out(fitted, rows, seq_len + 1, (np.int32, bool))
        return cls(ids, starts, train, real, len(examples), num_long)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> Batch:
        return row_at(self, index)

    def windows(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """Ids [B, S+1] and the flags [B, S+1] starts, train, real of rows ``rows`` [B]."""
        rows = np.asarray(rows, dtype=np.int64)
        return self.ids[rows], self.starts[rows], self.train[rows], self.real[rows]

    def gather(self, rows: np.ndarray) -> Batch:
        """The Batch of rows ``rows`` [B]: every field [B, S]."""
        return flagged_batch(*self.windows(rows))


def lay_out(pieces: list[tuple[np.ndarray, ...]], rows: list[list[int]], width: int, dtypes):
    """Rows of pieces, each piece a tuple of [n] arrays (ids, flags, ...) of ``dtypes``: the
    arrays [R, width] (each piece after the one before it in its row, zero after), then the
    flags [R, width] bool ``starts`` (a piece's first slot) and ``real`` (not padding)."""
    shape = (len(rows), width)
    planes = [np.zeros(shape, dtype) for dtype in dtypes]
    starts, real = np.zeros(shape, bool), np.zeros(shape, bool)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = len(pieces[i][0])
            for plane, values in zip(planes, pieces[i], strict=True):
                plane[r, at : at + n] = values
            if n:
                starts[r, at] = True
            at += n
        real[r, :at] = True
    return (*planes, starts, real)


def flagged_batch(ids, starts, train, real) -> Batch:
    """The Batch [B, S] of rows given as ids and the flags starts, train, real [B, S+1]."""
    b = rows_batch(ids, starts)
    pad = ~real[:, :-1]
    return b._replace(
        segment_ids=np.where(pad, 0, b.segment_ids).astype(np.int32),
        positions=np.where(pad, 0, b.positions).astype(np.int32),
        mask=(train[:, 1:] & real[:, 1:] & ~starts[:, 1:]).astype(np.float32),
    )


def packing_stats(rows) -> dict:
    """Packing efficiency of rows (in memory): the share of the rows' S target positions that
    are real tokens, and of those the share the loss counts (of the student's rows, for
    cross-tokenizer rows)."""
    rows = getattr(rows, "student", rows)
    positions = len(rows) * rows.seq_len
    if isinstance(rows, ExampleRows):
        real = int(rows.real[:, 1:].sum())
        trained = int((rows.train[:, 1:] & rows.real[:, 1:] & ~rows.starts[:, 1:]).sum())
    else:  # text: every slot real; a target that opens a document is not trained on
        real = positions
        trained = positions - int(rows.doc_start[1 : positions + 1].sum())
    return {
        "rows": len(rows),
        "documents": rows.num_documents,
        "real_fraction": real / max(positions, 1),
        "trained_fraction": trained / max(real, 1),
        "longer_than_row": getattr(rows, "num_long", 0),
    }
