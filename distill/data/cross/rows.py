"""Cross-tokenizer rows: each packed student row with the teacher's own tokens of its text.

The student's rows are packed as today (`distill.data.corpus.PackedRows`, concat-then-split
of ``[BOS] + tokens + [EOS]`` per document). For every row, each run of one document's slots
(a segment) is turned back into its text through the student tokenizer's character offsets,
and that text is tokenised by the teacher's tokenizer, with its BOS and EOS where the
student's segment has them: the teacher's row holds exactly the row's text, in the
teacher's tokens. Rows of text differ in how many teacher tokens they take, so the teacher's
rows are padded to one length T: the most any row of the corpus needs (train and eval),
rounded up to a multiple of 8; the teacher runs on [B, T] rows. All of this happens once,
when the corpus is built, never in the training loop.

Alignment. Student position j (predicting slot j + 1 from the text up to slot j) is matched
to teacher position i when both prefixes end at the same character of the same document
segment: slot j's text ends where teacher slot i's ends (BOS matches BOS, EOS matches EOS).
A token that ends inside a character (one byte of a multi-byte character, whose offsets span
the whole character) does not end a prefix: only the last of a run of tokens with the same
end counts. Unmatched positions get -1; the loss leaves them out of its divergence (their
cross-entropy still counts), and the share of student tokens aligned is reported. A row
that opens inside a character (the previous row took its first bytes) gives the teacher the
text after that character: the student's slots within it have no match.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from distill.config import DataConfig
from distill.data.corpus import Corpus, PackedRows
from distill.data.loader import held_out, load_documents, log_packing
from distill.data.packing import flagged_batch
from distill.data.tokenizers import Tokenizer, build_tokenizer
from distill.errors import DistillError
from distill.types import Batch, TeacherView

log = logging.getLogger("distill")

BOS, TEXT, EOS = 0, 1, 2
_ENCODE_CHUNK = 4096  # segment texts per teacher tokenizer call
ROW_MULTIPLE = 8  # teacher rows are padded to a multiple of this many tokens


class CrossRows:
    """Student rows (`PackedRows`) with the teacher's rows of the same text and the
    alignment; ``gather`` returns a Batch whose ``teacher`` is a `TeacherView`.

    Holds the teacher's ids, starts and real flags [R, T + 1] and align [R, S] int32; the
    student's rows are `PackedRows`, or `ExampleRows` of conversations and pairs
    (`distill.data.cross.examples`, whose teacher rows flag what its loss counts: `t_train`).
    """

    def __init__(self, student: PackedRows, t_ids, t_starts, t_real, align, t_train=None):
        self.student = student
        self.t_ids, self.t_starts, self.t_real, self.align = t_ids, t_starts, t_real, align
        self.t_train = t_real if t_train is None else t_train
        self.seq_len = student.seq_len
        self.teacher_len = t_ids.shape[1] - 1
        self.num_tokens = student.num_tokens
        self.num_documents = student.num_documents
        self.stream = student.stream  # what `distill.identity.data_hash` reads
        self.doc_start = getattr(student, "doc_start", None)
        self.num_long = getattr(student, "num_long", 0)

    def successions(self) -> tuple[np.ndarray, np.ndarray]:
        """The student's tokens as one stream [n] and where a token does not follow the one
        before it in the same document [n] bool (`FirstBytes.after_tokens` reads both): a
        packed corpus's document starts; for rows of whole examples, each example's start,
        the padding and each row's first token."""
        if self.doc_start is not None:
            return self.stream, self.doc_start
        breaks = self.student.starts | ~self.student.real
        breaks[:, 0] = True
        return self.student.ids.reshape(-1), breaks.reshape(-1)

    def __len__(self) -> int:
        return len(self.student)

    def gather(self, rows: np.ndarray) -> Batch:
        rows = np.asarray(rows, dtype=np.int64)
        teacher = flagged_batch(self.t_ids[rows], self.t_starts[rows], self.t_train[rows],
                                self.t_real[rows])  # fmt: skip
        return self.student.gather(rows)._replace(teacher=TeacherView(teacher, self.align[rows]))

    def aligned_fraction(self) -> float:
        """The share of the student's trained positions matched to a teacher position."""
        mask = self.student.gather(np.arange(len(self))).mask
        return float(((self.align >= 0) & (mask > 0)).sum() / max(mask.sum(), 1))


def _slots(texts: list[str], offsets: list[np.ndarray]):
    """Per slot of the packed stream: document index, kind (BOS/TEXT/EOS), start and end
    character, in `PackedRows`' layout ([BOS] + tokens + [EOS] per document)."""
    doc, kind, lo, hi = [], [], [], []
    for d, (text, off) in enumerate(zip(texts, offsets, strict=True)):
        n = len(off)
        doc.append(np.full(n + 2, d, np.int64))
        kind.append(np.concatenate([[BOS], np.full(n, TEXT), [EOS]]))
        lo.append(np.concatenate([[0], off[:, 0], [len(text)]]))
        hi.append(np.concatenate([[0], off[:, 1], [len(text)]]))
    return tuple(np.concatenate(a).astype(np.int64) for a in (doc, kind, lo, hi))


def _prefix_ends(doc, kind, end) -> np.ndarray:
    """[n] bool: whether each slot ends a prefix (not followed, in the same document, by a
    text slot with the same end: one byte of a multi-byte character)."""
    same = np.zeros(len(doc), bool)
    same[:-1] = (doc[1:] == doc[:-1]) & (kind[1:] == TEXT) & (kind[:-1] == TEXT)
    same[:-1] &= end[1:] == end[:-1]
    return ~same


def _keys(seg, kind, end) -> np.ndarray:
    return (seg << 42) | (kind << 40) | end


def _segments(window, doc, kind, lo, hi, texts):
    """(segment index per slot [S+1], texts to tokenise, their (doc, char start), and
    whether each segment opens with BOS / closes with EOS) of one row's slots `window`."""
    d = doc[window]
    cut = np.flatnonzero(d[1:] != d[:-1]) + 1
    bounds = np.concatenate([[0], cut, [len(window)]])
    seg = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:] - 1, strict=True):
        sa, sb = window[a], window[b]
        start = 0 if kind[sa] == BOS else lo[sa]
        if kind[sa] == TEXT and sa > 0 and doc[sa - 1] == doc[sa] and hi[sa - 1] > start:
            start = hi[sa - 1]  # the row opens inside a character: its text starts after it
        stop = len(texts[doc[sa]]) if kind[sb] == EOS else max(hi[sb], start)
        parts.append((int(doc[sa]), int(start), int(stop), kind[sa] == BOS, kind[sb] == EOS))
    return seg, parts


def teacher_rows(
    texts: list[str], offsets: list[np.ndarray], rows: PackedRows, teacher: Tokenizer
) -> tuple[list[tuple[np.ndarray, ...]], np.ndarray]:
    """Each row's teacher slots (ids, starts, keys [L + 1]) and the alignment [R, S]
    (int32, -1 unmatched), for student rows `rows` packed from `texts` whose tokens have
    character `offsets`."""
    s = rows.seq_len
    windows = [r * s + np.arange(s + 1) for r in range(len(rows))]
    out, align = slot_rows(texts, _slots(texts, offsets), windows, teacher)
    return out, np.asarray(align, np.int32).reshape(len(rows), s)


def slot_rows(
    texts: list[str], slots: tuple[np.ndarray, ...], windows: list[np.ndarray], teacher: Tokenizer
) -> tuple[list[tuple[np.ndarray, ...]], list[np.ndarray]]:
    """Each window's teacher slots (ids, starts, keys [L + 1]) and alignment [len - 1]
    (int32, -1 unmatched). `slots`: (document, kind, start and end character) of a stream
    of documents' slots in `_slots`' layout (a document's BOS or EOS may be absent: text
    that goes on beyond the stream); `windows`: each row's consecutive slot indices."""
    doc, kind, lo, hi = slots
    ends = _prefix_ends(doc, kind, hi)
    per_row, wanted = [], []
    for window in windows:
        seg, parts = _segments(window, doc, kind, lo, hi, texts)
        per_row.append((window, seg, parts))
        wanted += [texts[d][a:b] for d, a, b, _, _ in parts]
    encoded = []
    for i in range(0, len(wanted), _ENCODE_CHUNK):
        encoded += teacher.encode_offsets(wanted[i : i + _ENCODE_CHUNK])
    out, align, k = [], [], 0
    for window, seg, parts in per_row:
        ids, starts, keys = [], [], []
        for p, (_, start, stop, has_bos, has_eos) in enumerate(parts):
            t_ids, t_off = encoded[k]
            k += 1
            t_end = t_off[:, 1] + start
            live = _prefix_ends(np.zeros(len(t_end), np.int64), np.full(len(t_end), TEXT), t_end)
            t_keys = np.where(live, _keys(p, TEXT, t_end), -1)
            if has_bos:
                ids.append([teacher.bos_id]), starts.append([True])
                keys.append([_keys(p, BOS, start)])
            ids.append(t_ids), starts.append(np.zeros(len(t_ids), bool)), keys.append(t_keys)
            if has_eos:
                ids.append([teacher.eos_id]), starts.append([False])
                keys.append([_keys(p, EOS, stop)])
        ids, starts, keys = (np.concatenate(a) for a in (ids, starts, keys))
        out.append((ids.astype(np.int32), starts.astype(bool), keys.astype(np.int64)))
        align.append(_match(window[:-1], seg[:-1], kind, hi, ends, keys[:-1]))
    return out, align


def _match(slots, seg, kind, hi, ends, t_keys) -> np.ndarray:
    """[S] teacher position of each student slot whose prefix end a teacher slot shares
    (teacher slots up to the row's second last, so each has a target), else -1."""
    keys = _keys(seg, kind[slots], hi[slots])
    order = np.argsort(t_keys, kind="stable")
    sorted_keys = t_keys[order]
    at = np.clip(np.searchsorted(sorted_keys, keys), 0, max(len(order) - 1, 0))
    hit = (len(order) > 0) & (sorted_keys[at] == keys) & ends[slots]
    return np.where(hit, order[at], -1).astype(np.int32)


def pad_rows(rows: list[tuple[np.ndarray, ...]], length: int, pad_id: int):
    """Teacher ids, starts and real flags [R, length + 1] of variable-length rows."""
    shape = (len(rows), length + 1)
    ids = np.full(shape, pad_id, np.int32)
    starts, real = np.zeros(shape, bool), np.zeros(shape, bool)
    for r, (t_ids, t_starts, _) in enumerate(rows):
        ids[r, : len(t_ids)], starts[r, : len(t_ids)], real[r, : len(t_ids)] = t_ids, t_starts, True
    return ids, starts, real


def teacher_length(rows: list[tuple[np.ndarray, ...]], multiple: int = ROW_MULTIPLE) -> int:
    """The teacher's row length T: the most tokens any row needs (less the one shared with
    the next row), rounded up to a multiple of `multiple` (`row_multiple`)."""
    need = max((len(ids) - 1 for ids, _, _ in rows), default=1)
    return -(-max(need, 1) // multiple) * multiple


def row_multiple(teacher_cp: int = 1, student_cp: int = 1) -> int:
    """What the teacher's row length T is a multiple of: ROW_MULTIPLE, and with context
    parallelism what each role splits T into: 2 x `mesh.teacher.cp` load-balanced chunks
    for the teacher, `mesh.student.cp` row-order blocks where the student holds the teacher's
    rows (its evaluation). Up to a teacher cp of 4 and a student cp of 8, ROW_MULTIPLE."""
    return math.lcm(ROW_MULTIPLE, 2 * teacher_cp, student_cp)


def cross_splits(
    splits: dict[str, tuple[list[str], list[np.ndarray], list[np.ndarray]]],
    seq_len: int,
    student: Tokenizer,
    teacher: Tokenizer,
    multiple: int = ROW_MULTIPLE,
) -> dict[str, CrossRows]:
    """CrossRows of each split, given as (texts, student ids, student offsets), with one
    teacher row length for all splits (a multiple of `multiple`)."""
    made = {}
    for name, (texts, ids, offsets) in splits.items():
        packed = PackedRows(ids, seq_len, student.bos_id, student.eos_id)
        made[name] = (packed, *teacher_rows(texts, offsets, packed, teacher))
    length = max(teacher_length(rows, multiple) for _, rows, _ in made.values())
    pad = teacher.pad_id if teacher.pad_id is not None else teacher.eos_id
    return {
        name: CrossRows(packed, *pad_rows(rows, length, pad), align)
        for name, (packed, rows, align) in made.items()
    }


def cross_corpus(
    cfg: DataConfig, seq_len: int, teacher: Tokenizer, progress=None, multiple=ROW_MULTIPLE
) -> Corpus:
    """Text documents tokenised by both tokenizers, held out as ``tokenize_corpus`` holds
    them out (by the student's tokens), packed into the student's rows with the teacher's
    rows of the same text and the alignment (``distill.data.cross.rows``); the teacher's
    rows a multiple of `multiple` long (`row_multiple`)."""
    if cfg.prepared_dir is not None:  # (conversations and pairs: distill.data.cross.examples)
        raise DistillError(
            "teacher.tokenizer: a teacher tokenizer of its own needs the documents read here;"
            " data.prepared_dir is not supported across tokenizers yet"
        )
    student = build_tokenizer(cfg)
    texts = load_documents(cfg, student.vocab_size, progress)
    if not all(isinstance(t, str) for t in texts):
        raise DistillError(
            "teacher.tokenizer: pre-tokenised ArrayRecord documents hold no text for the"
            " teacher's tokenizer; give text, JSONL or Parquet data.source"
        )
    encoded = student.encode_offsets(texts)
    ids = [e[0] for e in encoded]
    if len(ids) < 2:
        raise DistillError("teacher.tokenizer: needs at least 2 documents (train and eval)")
    is_eval = held_out(ids, cfg.eval_fraction, seq_len + 1, extra=2)
    splits = {
        name: tuple([part[i] for i in np.flatnonzero(is_eval == want)]
                    for part in (texts, ids, [e[1] for e in encoded]))
        for name, want in (("train", False), ("eval", True))
    }  # fmt: skip
    rows = cross_splits(splits, seq_len, student, teacher, multiple)
    for name, part in rows.items():
        if len(part) < 1:
            raise DistillError(
                f"data.source: '{cfg.source}' gives no {name} row of train.seq_len={seq_len}"
                " student tokens; add data or lower train.seq_len"
            )
    corpus = Corpus(tokenizer=student, train=rows["train"], eval=rows["eval"], teacher=teacher)
    log_packing(corpus, cfg)
    log.info(
        "data: teacher rows of %d tokens for student rows of %d; %.1f%% of student train"
        " tokens aligned to a teacher token",
        rows["train"].teacher_len,
        seq_len,
        100 * rows["train"].aligned_fraction(),
    )
    return corpus
