"""Cross-tokenizer rows of conversations and prompt/completion pairs: each side renders a
record with its own chat template, and the two renderings are aligned through the answers.

The student's rows are packed as with one tokenizer (`distill.data.packing`: whole examples
best-fit, a longer one cut or split). The teacher renders the same conversation with its own
template (``teacher.chat_template``, else the one saved beside ``teacher.tokenizer``) and
tokenises it; a pair is the same text on both sides, ``[BOS] + prompt + completion + [EOS]``
in each tokenizer's own BOS and EOS. The texts of a conversation differ (role markers, BOS,
trimming), so the sides are aligned through the answers alone: each assistant message's
content (a pair's completion) is found, in order, inside the answer spans of each rendering
(`distill.data.chat`), as it is or, where a template trims it, stripped of the whitespace
around it (the same form on both sides).

Alignment. Student position j (predicting slot j + 1 from the text up to slot j) is matched to
teacher position i when both tokens end at the same character of the same answer, counted
from the answer's start: at offset 0 both predict the answer's first token, at its end both
predict their own end-of-turn token. A token that ends inside a character (the next token
starts before its end: one byte of a multi-byte character) ends no prefix. Positions outside
the answers, and positions the student's loss does not count, are not aligned (-1); the
share of counted positions aligned is reported as for text.

Packing lays the teacher's pieces out in the student's row order: for every student piece of
a record, the teacher's tokens of the same stretch of the conversation. A record cut at
``train.seq_len`` (or a window of a split one) maps its first and last student characters
into the teacher's text (inside an answer: the same offset; elsewhere: the end of the answer
before, or the start of the text) and keeps the teacher's tokens between them. The teacher's
rows are padded to one length T, as text rows are (`distill.data.cross.rows`). All of this
happens once, when the corpus is built, never in the training loop.
"""

from __future__ import annotations

import logging

import numpy as np

from distill.config import DataConfig
from distill.data.chat import load_template
from distill.data.corpus import Corpus
from distill.data.cross.rows import ROW_MULTIPLE, CrossRows
from distill.data.examples import read_examples, tokenise_examples
from distill.data.loader import held_out_records, log_packing, resolve_paths
from distill.data.packing import ExampleRows, best_fit, fit_pieces, lay_out
from distill.data.tokenizers import Tokenizer, build_tokenizer
from distill.errors import DistillError

log = logging.getLogger("distill")

Example = tuple[np.ndarray, np.ndarray, np.ndarray]  # ids [n], train [n], offsets [n, 2]


def answer_starts(text: str, spans: list[tuple[int, int]], answers: list[str]) -> list[int]:
    """Where each of ``answers`` starts in ``text``: inside one of the answer ``spans``, each
    after the one before it; -1 where it is not found (or empty)."""
    out, at, k = [], 0, 0
    for answer in answers:
        found = -1
        for j in range(k, len(spans) if answer else 0):
            lo, hi = spans[j]
            pos = text.find(answer, max(lo, at), hi)
            if pos >= 0:
                found, k, at = pos, j, pos + len(answer)
                break
        out.append(found)
    return out


def regions(student: tuple[str, list], teacher: tuple[str, list], answers: list[str]):
    """The answers found in both renderings (each a (text, answer spans)): their starts in
    the student's text, in the teacher's, and their lengths, each [a] int64. An answer is
    taken as it is where both texts hold it so, else stripped; one found on only one side,
    or out of order, is left out."""
    stripped = [a.strip() for a in answers]
    exact = [answer_starts(text, spans, answers) for text, spans in (student, teacher)]
    trimmed = [answer_starts(text, spans, stripped) for text, spans in (student, teacher)]
    out, s_end, t_end = [], 0, 0
    for n, answer in enumerate(answers):
        for (s_at, t_at), form in (((exact[0][n], exact[1][n]), answer),
                                   ((trimmed[0][n], trimmed[1][n]), stripped[n])):  # fmt: skip
            if min(s_at, t_at) >= 0:
                if s_at >= s_end and t_at >= t_end:
                    out.append((s_at, t_at, len(form)))
                    s_end, t_end = s_at + len(form), t_at + len(form)
                break
    return tuple(np.array(out, np.int64).reshape(-1, 3).T)


def token_keys(offsets: np.ndarray, lo: np.ndarray, length: np.ndarray) -> np.ndarray:
    """[n] int64: for each token (character ``offsets`` [n, 2]) that ends a prefix at a
    character of an answer (starting at ``lo`` [a] in this text, ``length`` [a] long), that
    character counted through all the answers (answer k's count starts past the ones before
    it, each length + 1), else -1. A zero-width token after the first (a pair's EOS) has none."""
    start, end = offsets[:, 0], offsets[:, 1]
    ends_prefix = np.ones(len(end), bool)
    ends_prefix[:-1] = start[1:] >= end[:-1]  # else the next token shares its last character
    ends_prefix[1:] &= end[1:] > start[1:]
    if not len(lo):
        return np.full(len(end), -1, np.int64)
    k = np.searchsorted(lo, end, side="right") - 1
    kk = np.maximum(k, 0)
    inside = (k >= 0) & (end - lo[kk] <= length[kk]) & ends_prefix
    base = np.concatenate([[0], np.cumsum(length + 1)[:-1]])
    return np.where(inside, base[kk] + end - lo[kk], -1)


def to_teacher(c: int, s_lo: np.ndarray, t_lo: np.ndarray, length: np.ndarray) -> int:
    """The teacher's character for the student's character ``c``: the same offset inside an
    answer, else the end of the answer before it (0 before the first)."""
    k = int(np.searchsorted(s_lo, c, side="right")) - 1
    return 0 if k < 0 else int(t_lo[k] + min(c - s_lo[k], length[k]))


def teacher_piece(lo: int, hi: int, s_off, t_off, region) -> tuple[int, int]:
    """The teacher's tokens [a, b) of the stretch of a record the student's tokens [lo, hi)
    hold (``region``: `regions` of the record)."""
    s_lo, t_lo, length = region
    a = 0
    if lo > 0:
        a = int(np.searchsorted(t_off[:, 0], to_teacher(s_off[lo, 0], s_lo, t_lo, length)))
    b = len(t_off)
    if hi < len(s_off):
        c = to_teacher(s_off[hi - 1, 1], s_lo, t_lo, length)
        b = int(np.searchsorted(t_off[:, 1], c, side="right"))
    return a, max(a, b)


def pack_split(
    student: list[Example], teacher: list[Example], region: list, seq_len: int, split_long: bool
):
    """The student's ExampleRows of one split, the teacher's pieces (ids, train, key + 1) in
    the same row order, and the student's slot keys + 1 [R, S + 1] (0: no key; a key names
    its piece, so the rows need no other index)."""
    pieces, num_long = fit_pieces([train for _, train, _ in student], seq_len, split_long)
    rows = best_fit(np.array([hi - lo for _, lo, hi in pieces], np.int64), seq_len + 1)
    s_pieces, t_pieces = [], []
    for p, (i, lo, hi) in enumerate(pieces):
        (ids, train, off), (t_ids, t_train, t_off) = student[i], teacher[i]
        s_lo, t_lo, length = region[i]
        a, b = teacher_piece(lo, hi, off, t_off, region[i])
        s_keys = _tagged(token_keys(off, s_lo, length)[lo:hi], p)
        s_pieces.append((ids[lo:hi], train[lo:hi], s_keys))
        t_keys = _tagged(token_keys(t_off, t_lo, length)[a:b], p)
        t_pieces.append((t_ids[a:b], t_train[a:b], t_keys))
    planes = lay_out(s_pieces, rows, seq_len + 1, (np.int32, bool, np.int64))
    ids, train, keys, starts, real = planes
    rows_out = ExampleRows(ids, starts, train, real, len(student), num_long)
    return rows_out, [[t_pieces[i] for i in row] for row in rows], keys


def _tagged(keys: np.ndarray, piece: int) -> np.ndarray:
    """Keys of one piece's tokens made unique across pieces, + 1 (0: no key)."""
    return np.where(keys >= 0, (piece << 32) + keys + 1, 0)


def _align(s_keys: np.ndarray, t_keys: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[R, S] int32 teacher position of each student position whose key (+ 1; 0 none) a
    teacher input position [R, T] shares and whose target the loss counts (``mask`` [R, S]
    bool), else -1."""
    flat = t_keys.reshape(-1)
    order = np.argsort(flat, kind="stable")
    ranked = flat[order]
    at = np.clip(np.searchsorted(ranked, s_keys), 0, max(len(flat) - 1, 0))
    hit = (s_keys > 0) & (ranked[at] == s_keys) & mask
    return np.where(hit, order[at] % t_keys.shape[1], -1).astype(np.int32)


def split_rows(student: ExampleRows, t_rows: list, keys: np.ndarray, length: int, pad_id: int):
    """CrossRows of a split: the teacher's pieces laid out in rows of ``length`` + 1 slots."""
    pieces = [p for row in t_rows for p in row]
    at = np.cumsum([0] + [len(row) for row in t_rows])
    layout = [list(range(a, b)) for a, b in zip(at[:-1], at[1:], strict=True)]
    t_ids, t_train, t_keys, t_starts, t_real = lay_out(
        pieces, layout, length + 1, (np.int32, bool, np.int64)
    )
    t_ids[~t_real] = pad_id
    counted = student.train[:, 1:] & student.real[:, 1:] & ~student.starts[:, 1:]  # the mask
    align = _align(keys[:, :-1], t_keys[:, :-1], counted)
    return CrossRows(student, t_ids, t_starts, t_real, align, t_train=t_train)


def _sides(cfg: DataConfig, student: Tokenizer, teacher: Tokenizer, teacher_cfg):
    """Each usable record tokenised by both sides, with its answers' `regions`."""
    templates = ()
    if cfg.format == "chat":
        variables = cfg.chat_template_kwargs
        templates = (
            load_template(cfg, student),
            load_template(teacher_cfg, teacher, "teacher", variables),
        )
    texts = read_examples(cfg, resolve_paths(cfg), templates)
    s_renders = [r[0] for r, _, _ in texts]
    t_renders = [r[-1] for r, _, _ in texts]  # a pair has one text for both sides
    s_examples = tokenise_examples(cfg, student, s_renders)
    t_examples = tokenise_examples(cfg, teacher, t_renders)
    found = [regions(s, t, a) for s, t, (_, a, _) in zip(s_renders, t_renders, texts, strict=True)]
    records = np.array([rec for _, _, rec in texts], dtype=np.int64)
    return s_examples, t_examples, found, records


def cross_example_corpus(
    cfg: DataConfig, seq_len: int, teacher: Tokenizer, teacher_cfg, multiple: int = ROW_MULTIPLE
) -> Corpus:
    """Conversations (or pairs) rendered and tokenised by each side, whole records held out
    as ``distill.data.loader`` holds them out (by the student's tokens), packed into the
    student's rows with the teacher's rows of the same records and the alignment.
    ``teacher_cfg``: the teacher's ``tokenizer`` and ``chat_template`` keys; the teacher's
    rows a multiple of `multiple` long (``distill.data.cross.rows.row_multiple``)."""
    if cfg.prepared_dir is not None:
        raise DistillError(
            "data.prepared_dir: a prepared corpus holds no teacher rows; with a teacher.tokenizer"
            " of its own the data are read here (unset data.prepared_dir)"
        )
    student = build_tokenizer(cfg)
    s_examples, t_examples, found, records = _sides(cfg, student, teacher, teacher_cfg)
    is_eval = held_out_records([ids for ids, _, _ in s_examples], records, cfg)
    packed = {}
    for split, want in (("train", False), ("eval", True)):
        keep = np.flatnonzero(is_eval == want)
        packed[split] = pack_split(
            [s_examples[i] for i in keep], [t_examples[i] for i in keep],
            [found[i] for i in keep], seq_len, cfg.long_conversations == "split",
        )  # fmt: skip
        if len(packed[split][0]) < 1:
            raise DistillError(
                f"data.source: no {split} row of train.seq_len={seq_len} tokens holds an answer"
                " to learn; raise train.seq_len or set data.long_conversations: split"
            )
    need = max(sum(len(p[0]) for p in row) - 1 for _, t, _ in packed.values() for row in t)
    length = -(-max(need, 1) // multiple) * multiple
    pad = teacher.pad_id if teacher.pad_id is not None else teacher.eos_id
    rows = {name: split_rows(*part, length, pad) for name, part in packed.items()}
    corpus = Corpus(tokenizer=student, train=rows["train"], eval=rows["eval"], teacher=teacher)
    log_packing(corpus, cfg)
    log.info(
        "data: teacher rows of %d tokens for student rows of %d; %.1f%% of the student's"
        " trained train tokens aligned to a teacher token (through the answers)",
        length,
        seq_len,
        100 * rows["train"].aligned_fraction(),
    )
    return corpus
