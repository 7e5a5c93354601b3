"""Packed rows and the corpus that serves them as shuffled, resumable batches.

Packing is concat-then-split: every document becomes ``[BOS] + tokens + [EOS]``, all of them
are concatenated into one stream, and row ``i`` is ``stream[i*S : i*S + S + 1]`` (rows
overlap by one token so every input token has a target). Per row we derive ``segment_ids``
(1, 2, ... per document in the row), ``positions`` (restarting at 0 at each document start,
and also at 0 for the row's first, possibly continuing, document: attention never crosses
rows, so positions only need to be consistent within a row) and ``mask`` (0 where the target
starts another document, so nothing is predicted across a document boundary).

Rows live in memory (``PackedRows``, made by ``distill.data.loader``) or on disk
(``distill.data.prepared.StoredRows``); a ``Corpus`` serves either the same way. This module reads
no files, so both of those import it and neither imports the other's way of making rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import grain
import jax
import numpy as np

from distill.data.tokenizers import Tokenizer
from distill.types import Batch

# The corpus is already in memory; a couple of threads and a short buffer keep a few
# batches ready without holding hundreds of them.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


class PackedRows:
    """Random-access packed rows over one token stream; row i is Batch of [S] arrays.

    Holds only the stream [T] int32 and a parallel doc-start flag [T] bool (True at each
    document's first token, i.e. its BOS); per-row fields are derived on access, vectorised
    over a batch of row indices, so memory stays ~5 bytes per token.
    """

    def __init__(self, docs: list[np.ndarray], seq_len: int, bos_id: int, eos_id: int):
        lens = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs)) + 2
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        total = int(lens.sum())
        self.stream = np.empty(total, dtype=np.int32)
        is_body = np.ones(total, dtype=bool)
        is_body[starts] = False
        is_body[starts + lens - 1] = False
        self.stream[starts] = bos_id
        self.stream[starts + lens - 1] = eos_id
        if docs:
            self.stream[is_body] = np.concatenate(docs)
        self.doc_start = np.zeros(total, dtype=bool)
        self.doc_start[starts] = True
        self.seq_len = seq_len
        self.num_tokens = total
        self.num_documents = len(docs)

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def __getitem__(self, index: int) -> Batch:
        return row_at(self, index)

    def windows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token ids [B, S+1] int32 and doc-start flags [B, S+1] bool of rows ``rows`` [B]."""
        s = self.seq_len
        window = np.asarray(rows, dtype=np.int64)[:, None] * s + np.arange(s + 1)
        return self.stream[window], self.doc_start[window]

    def gather(self, rows: np.ndarray) -> Batch:
        """The Batch of rows ``rows`` [B]: every field [B, S]."""
        return rows_batch(*self.windows(rows))


def row_at(rows, index: int) -> Batch:
    """Row ``index`` of ``rows`` (anything with ``len`` and ``gather``) as a Batch of [S]."""
    if not 0 <= index < len(rows):
        raise IndexError(f"row {index} out of range [0, {len(rows)})")
    return jax.tree.map(lambda x: x[0], rows.gather(np.array([index])))


def rows_batch(ids: np.ndarray, starts: np.ndarray) -> Batch:
    """The Batch [B, S] of packed rows given as token ids [B, S+1] and doc-start flags [B, S+1]
    (the last column is the first token after the row: the last target, and whether it opens
    a new document)."""
    s = ids.shape[1] - 1
    new_doc = starts[:, :-1].copy()
    new_doc[:, 0] = True  # the row's first token opens segment 1, position 0
    ar = np.arange(s, dtype=np.int32)
    seg_start = np.maximum.accumulate(np.where(new_doc, ar, 0), axis=1)
    return Batch(
        tokens=ids[:, :-1],
        targets=ids[:, 1:],
        segment_ids=np.cumsum(new_doc, axis=1, dtype=np.int32),
        positions=(ar - seg_start).astype(np.int32),
        mask=(~starts[:, 1:]).astype(np.float32),  # target opens a new doc: no loss
    )


def _shuffle_seed(seed: int) -> int:
    """Grain wants a seed in [0, 2**32); mix the run seed so nearby seeds look unrelated."""
    return int(np.random.SeedSequence(seed % 2**64).generate_state(1)[0])


@dataclass
class Corpus:
    """Packed train and eval rows of one corpus, and the tokenizer that made them.

    The rows are ``PackedRows`` in memory, or ``distill.data.prepared.StoredRows`` read from a
    prepared corpus on demand; both have ``len`` and ``gather``, so batches are the same.
    ``fingerprint`` is the prepared corpus's stored hash of its packed streams (see
    ``distill.identity.data_hash``), None for rows in memory. ``teacher``: the teacher's
    tokenizer when it has its own (the rows are then ``distill.data.cross.rows.CrossRows``).
    """

    tokenizer: Tokenizer
    train: PackedRows
    eval: PackedRows
    fingerprint: str | None = None
    teacher: Tokenizer | None = None  # the teacher's own tokenizer (cross-tokenizer rows)

    @property
    def teacher_tokenizer(self) -> Tokenizer:
        """The tokenizer of the teacher's tokens: its own, or the student's."""
        return self.tokenizer if self.teacher is None else self.teacher

    @property
    def train_rows(self) -> int:
        return len(self.train)

    @property
    def eval_rows(self) -> int:
        return len(self.eval)

    def train_dataset(self, batch_size: int, seed: int) -> grain.MapDataset:
        """Infinite MapDataset of Batch [batch_size, S]: row order shuffled by ``seed``,
        reshuffled every epoch (grain folds the epoch into the shuffle seed); the batch
        index is the whole state, so any batch is addressable directly."""
        return self.train_row_ids(batch_size, seed).map(self.train.gather)

    def train_row_ids(self, batch_size: int, seed: int) -> grain.MapDataset:
        """The row ids [batch_size] of each batch of ``train_dataset``, without reading the
        rows (a process that needs only some rows of a batch reads those). Records routed
        to several teachers in batches of one teacher each: `RoutedRows.grouped_row_ids`."""
        if getattr(self.train, "grouped", False):
            return self.train.grouped_row_ids(batch_size, seed)
        return (
            grain.MapDataset.range(self.train_rows)
            .shuffle(seed=_shuffle_seed(seed))
            .repeat(None)
            .batch(batch_size, drop_remainder=True)
        )

    def train_iterator(self, batch_size: int, seed: int) -> grain.DatasetIterator:
        """Iterator over ``train_dataset``. ``get_state()`` is ``{"next_index": n}`` (JSON);
        ``set_state`` on a fresh iterator with the same arguments resumes at batch n."""
        ds = self.train_dataset(batch_size, seed).to_iter_dataset(READ_OPTIONS)
        return iter(ds)

    def eval_batches(self, batch_size: int, n_batches: int) -> list[Batch]:
        """``n_batches * batch_size`` eval rows as batches, spread evenly over the held-out
        split (``eval_row_ids``)."""
        rows = eval_row_ids(self.eval_rows, n_batches * batch_size)
        return [self.eval.gather(r) for r in rows.reshape(n_batches, batch_size)]


def eval_row_ids(available: int, n: int) -> np.ndarray:
    """The ``n`` held-out rows evaluation reads out of ``available``: evenly spaced over the
    whole split in order (row floor(i * available / n)), so that every held-out document has
    its share, not the split's first few documents; every row, cycling, when ``n`` is more."""
    if n >= available:
        return np.arange(n) % available
    return np.arange(n) * available // n
