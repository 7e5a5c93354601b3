"""The teacher's rows of the student's own samples (`distill.data.cross.samples`): the one
alignment path of the corpus rows, on rows that exist only in the student's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from distill.data.cross.samples import SampleRows, spelled
from distill.data.token_bytes import token_bytes
from distill.data.tokenizers import ByteTokenizer
from distill.models.decode import continuation_batch, prompts_of
from tests.test_cross_tokenizer import TEXTS, _rows, bpe, metaspace  # noqa: F401


@pytest.mark.parametrize("pair", ["bpe-bytes", "bytes-bpe", "metaspace-bpe"])
def test_samples_view_of_corpus_rows_is_the_corpus_view(pair, bpe, metaspace):  # noqa: F811
    """Given the corpus's own rows as if sampled (tokens only, no text), the alignment is
    the corpus's, and so are the teacher's tokens up to the last aligned position (what its
    log-probs there read)."""
    named = {"bpe": bpe, "bytes": ByteTokenizer(), "metaspace": metaspace}
    student, teacher = (named[n] for n in pair.split("-"))
    rows = _rows(student, teacher)
    batch = rows.gather(np.arange(len(rows)))
    view = SampleRows(student, teacher, rows.teacher_len).view(batch._replace(teacher=None))
    m = batch.mask > 0
    np.testing.assert_array_equal(np.where(m, view.align, -1), np.where(m, batch.teacher.align, -1))
    assert (view.align[m] >= 0).any()
    for r in range(len(rows)):
        upto = int(np.max(np.where(m[r], batch.teacher.align[r], -1))) + 1
        np.testing.assert_array_equal(
            view.rows.tokens[r, :upto], batch.teacher.rows.tokens[r, :upto]
        )


def test_spelled_offsets_are_the_tokenizers_and_invalid_bytes_are_replaced(bpe):  # noqa: F811
    table = token_bytes(bpe)
    for text in TEXTS:
        ids, offsets = bpe.encode_offsets([text])[0]
        got, off = spelled(ids, table)
        assert got == text
        np.testing.assert_array_equal(off, offsets)
    raw = ByteTokenizer().encode("é😀a")[1:]  # opens with the tail byte of "é"
    text, off = spelled(raw, token_bytes(ByteTokenizer()))
    assert text == "\ufffd😀a" and off.tolist() == [[0, 1]] + [[1, 2]] * 4 + [[2, 3]]
    text, off = spelled(raw, token_bytes(ByteTokenizer()), inside=True)
    assert text == "😀a" and off.tolist() == [[0, 0]] + [[0, 1]] * 4 + [[1, 2]]


def test_continuations_are_aligned_and_cut_at_the_teacher_length(bpe):  # noqa: F811
    """Prompts and made-up continuations (an EOS, a stop mid-row, left-padded prompts): the
    teacher's row spells the student's text, every aligned pair ends the same prefix, and
    a continuation longer than T teacher tokens loses its alignment past T."""
    student, teacher = bpe, ByteTokenizer()
    rows = _rows(student, teacher, seq_len=24)
    batch = rows.gather(np.arange(4))
    prompts = prompts_of(batch, 6)
    seg = prompts.segment_ids.copy()
    seg[1, :2] = 0  # left padding
    prompts = prompts._replace(segment_ids=seg)
    gen = np.array([student.encode(TEXTS[1] + TEXTS[3])[:12]] * 4)
    gen[2, 5] = student.eos_id
    valid = np.ones_like(gen, bool)
    valid[3, 7:] = False
    rows_c = continuation_batch(prompts, gen, valid, 24)
    host = type(rows_c)(*(np.asarray(x) for x in rows_c[:5]))
    table, t_table = token_bytes(student), token_bytes(teacher)
    for t_len, full in ((rows.teacher_len, True), (16, False)):
        view = SampleRows(student, teacher, t_len).view(host)
        m = host.mask > 0
        assert view.rows.tokens.shape == (4, t_len)
        for r, j in np.argwhere(view.align >= 0):
            i = view.align[r, j]
            s_seg = host.segment_ids[r] == host.segment_ids[r, j]
            t_seg = view.rows.segment_ids[r] == view.rows.segment_ids[r, i]
            s_ids = host.tokens[r, np.flatnonzero(s_seg)[0] : j + 1]
            t_ids = view.rows.tokens[r, np.flatnonzero(t_seg)[0] : i + 1]
            spell = lambda ids, tb: b"".join(tb[k] or b"" for k in ids)  # noqa: E731
            assert spell(s_ids, table) == spell(t_ids, t_table), (r, j, i)
        if full:
            assert (view.align[m] >= 0).mean() > 0.9
        else:
            assert 0 < (view.align[m] >= 0).mean() < 0.9 and view.align.max() < 16
