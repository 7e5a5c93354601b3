"""The teacher's rows of the student's own samples (on-policy distillation across tokenizers).

An on-policy row (`distill.types.Continuations`: a prompt and the student's continuation,
then padding) exists only in the student's tokens. `SampleRows` turns each row back into
text, spelled by its tokens' bytes (`distill.data.token_bytes`), with every token's
character offsets, and builds the teacher's row of that text and the alignment by the one
code path of the corpus rows (`distill.data.cross.rows.slot_rows`): a document of the row
is cut where its segment id changes, at a BOS and after an EOS; a document the row enters
or leaves mid-way has no BOS or EOS there. The teacher's rows are padded to the corpus's
length T, so its program is the one compiled for the data's rows; a row whose text takes
more than T teacher tokens is cut at T and its student positions beyond have no match.
This runs on the host, once per on-policy batch (`pipelines.on_policy`).
"""

from __future__ import annotations

import codecs

import numpy as np

from distill.data.cross.rows import BOS, EOS, TEXT, pad_rows, slot_rows
from distill.data.packing import flagged_batch
from distill.data.token_bytes import token_bytes
from distill.data.tokenizers import Tokenizer
from distill.types import Batch, TeacherView


def spelled(
    ids: np.ndarray, table: list[bytes | None], inside: bool = False
) -> tuple[str, np.ndarray]:
    """(the text `ids` spell, each id's character offsets [n, 2] int64): the UTF-8 of their
    bytes (`token_bytes`; None and ids past the table spell nothing), invalid bytes as
    U+FFFD. A token that starts or ends inside a character spans the whole character, as a
    tokenizer's offsets do (`distill.data.cross.rows` reads such a token as ending no
    prefix). `inside`: the text opens inside a character, whose tail bytes it leaves out
    (as a corpus row that opens inside one gives the teacher the text after it)."""
    pieces = [table[i] if 0 <= i < len(table) and table[i] else b"" for i in ids.tolist()]
    data = b"".join(pieces)
    ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
    starts = ends - np.array([len(p) for p in pieces], np.int64)
    if inside:  # the tail of the character the text opens in
        tail = len(data) - len(data.lstrip(bytes(range(0x80, 0xC0))))
        data, starts, ends = data[tail:], np.maximum(starts - tail, 0), np.maximum(ends - tail, 0)
    try:
        text = data.decode("utf-8")
        raw = np.frombuffer(data, np.uint8)
        begins = np.concatenate([(raw & 0xC0) != 0x80, [True]])  # a character starts at k
        count = np.concatenate([[0], np.cumsum(begins[:-1])])  # characters begun before k
    except UnicodeDecodeError:  # invalid UTF-8: the replacing decoder, byte by byte
        text, begins, count = _replaced(data)
    at = np.flatnonzero(begins | (np.arange(len(data) + 1) == 0))  # character boundaries
    lo = count[at[np.searchsorted(at, starts, "right") - 1]]
    hi = count[at[np.searchsorted(at, ends, "left")]]
    return text, np.stack([lo, hi], axis=1).reshape(-1, 2)


def _replaced(data: bytes) -> tuple[str, np.ndarray, np.ndarray]:
    """(text, whether byte k ends a run of decoded characters [n + 1], characters decoded
    before k [n + 1]) of invalid UTF-8, U+FFFD for what does not decode."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    out, count, boundary = [], np.zeros(len(data) + 1, np.int64), np.ones(len(data) + 1, bool)
    for k in range(len(data)):
        out.append(dec.decode(data[k : k + 1], final=k == len(data) - 1))
        count[k + 1] = count[k] + len(out[-1])
        boundary[k + 1] = not dec.getstate()[0]
    return "".join(out), boundary, count


class SampleRows:
    """view(rows) -> `TeacherView` of host on-policy rows [B, S] (module docstring): the
    teacher's rows [B, T] of their text and the alignment [B, S]."""

    def __init__(self, student: Tokenizer, teacher: Tokenizer, teacher_len: int):
        self._student, self._teacher, self.teacher_len = student, teacher, teacher_len
        self._table = token_bytes(student)
        self._pad = teacher.pad_id if teacher.pad_id is not None else teacher.eos_id

    def view(self, rows: Batch) -> TeacherView:
        b, s = rows.tokens.shape
        texts, slots, windows, places = [], [], [], []
        for r in range(b):
            ids = np.append(rows.tokens[r], rows.targets[r, -1])
            seg = np.append(rows.segment_ids[r], rows.segment_ids[r, -1] * (rows.mask[r, -1] > 0))
            real = np.flatnonzero(seg > 0)  # the row's slots, between its padding
            if len(real) < 2:
                windows.append(np.zeros(0, np.int64)), places.append(real)
                continue
            start = sum(len(x[0]) for x in slots)
            self._documents(ids[real], seg[real], len(texts), texts, slots)
            windows.append(start + np.arange(len(real))), places.append(real[:-1])
        stream = tuple(np.concatenate([x[i] for x in slots]) for i in range(4)) if slots else None
        made = [w for w in windows if len(w)]
        out, aligns = slot_rows(texts, stream, made, self._teacher) if made else ([], [])
        t = self.teacher_len
        rows_t, align, k = [], np.full((b, s), -1, np.int32), 0
        for r, window in enumerate(windows):
            if not len(window):
                rows_t.append((np.zeros(0, np.int32), np.zeros(0, bool), None))
                continue
            ids, starts, _ = out[k]
            rows_t.append((ids[: t + 1], starts[: t + 1], None))
            align[r, places[r]] = np.where(aligns[k] < t, aligns[k], -1)  # past T: cut
            k += 1
        ids, starts, real = pad_rows(rows_t, t, self._pad)
        return TeacherView(flagged_batch(ids, starts, real, real), align)

    def _documents(self, ids, seg, first_doc: int, texts: list, slots: list) -> None:
        """Append the documents of one row's real slots `ids` (segment ids `seg`) to
        `texts`, and their slots (document, kind, start, end character) to `slots`."""
        st = self._student
        kind = np.where(ids == st.bos_id, BOS, np.where(ids == st.eos_id, EOS, TEXT))
        new = np.ones(len(ids), bool)
        new[1:] = (seg[1:] != seg[:-1]) | (kind[1:] == BOS) | (kind[:-1] == EOS)
        bounds = np.append(np.flatnonzero(new), len(ids))
        for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            k = kind[a:b]
            text, off = spelled(ids[a:b][k == TEXT], self._table, inside=k[0] == TEXT)
            lo, hi = np.zeros(b - a, np.int64), np.full(b - a, len(text), np.int64)
            lo[k == TEXT], hi[k == TEXT] = off[:, 0], off[:, 1]
            lo[k == EOS], hi[k == BOS] = len(text), 0
            texts.append(text)
            slots.append((np.full(b - a, first_doc + d, np.int64), k.astype(np.int64), lo, hi))
