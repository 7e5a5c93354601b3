"""The UTF-8 bytes each token id stands for, and the map between two vocabularies built on it.

Cross-tokenizer distillation (`distill.models.cross.losses`) compares a teacher's next-token
distribution with a student's over different vocabularies. Where a teacher token spells
exactly the bytes of a student token, the two are the same event ("the text goes on with
these bytes"), so the teacher's probability of one is the student's target for the other:
`VocabMap` holds that correspondence. A token's bytes also give each target's length in
bytes, so held-out losses of different tokenizers compare as bits per byte.

How the bytes are read: the byte tokenizer's ids are bytes; a SentencePiece model's pieces
have U+2581 for a space and ``<0xNN>`` byte pieces; a ``tokenizer.json`` whose decoder is
``ByteLevel`` (GPT-2 style) writes bytes as printable characters (bytes_to_unicode), one
whose decoder replaces U+2581 (``Metaspace``, or a SentencePiece-converted ``Sequence``)
is read as SentencePiece's. Special tokens (BOS, EOS, PAD, added specials) spell no text:
None; between two tokenizers they map by role (BOS to BOS, EOS to EOS).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

import numpy as np

from distill.data.tokenizers import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")
_SPACE = "\u2581"


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: char -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def _piece_bytes(piece: str) -> bytes:
    """A SentencePiece-style piece's bytes: U+2581 is a space, <0xNN> one byte."""
    m = _BYTE_PIECE.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace(_SPACE, " ").encode("utf-8")


def _hf_style(raw: dict) -> str:
    """'bytelevel', 'metaspace' or 'plain': how a tokenizer.json's pieces spell bytes."""
    text = json.dumps(raw.get("decoder") or {})
    if '"ByteLevel"' in text:
        return "bytelevel"
    if _SPACE in text or '"Metaspace"' in text or "\\u2581" in text:
        return "metaspace"
    return "plain"


def token_bytes(tok: Tokenizer) -> list[bytes | None]:
    """[vocab_size] the bytes each id spells; None for specials and unused ids."""
    specials = {tok.bos_id, tok.eos_id, tok.pad_id} - {None}
    if tok.kind == "bytes":
        return [None if i < 3 else bytes([i - 3]) for i in range(tok.vocab_size)]
    out: list[bytes | None] = [None] * tok.vocab_size
    if tok.kind == "sentencepiece":
        sp = tok._sp
        for i in range(tok.vocab_size):
            if not (sp.is_control(i) or sp.is_unknown(i) or i in specials):
                out[i] = _piece_bytes(sp.id_to_piece(i))
        return out
    raw = json.loads(tok._tok.to_str())
    style = _hf_style(raw)
    added = {t["id"] for t in raw.get("added_tokens", []) if t.get("special")}
    inverse = _bytes_to_unicode() if style == "bytelevel" else {}
    for piece, i in tok._tok.get_vocab(with_added_tokens=True).items():
        byte_piece = style == "metaspace" and _BYTE_PIECE.match(piece)
        if i in specials or (i in added and not byte_piece) or not 0 <= i < tok.vocab_size:
            continue  # (byte pieces some converted tokenizers list as added specials count)
        if style == "bytelevel":
            if all(c in inverse for c in piece):
                out[i] = bytes(inverse[c] for c in piece)
        elif style == "metaspace":
            out[i] = _piece_bytes(piece)
        else:
            out[i] = piece.encode("utf-8")
    return out


def byte_lengths(tok: Tokenizer, model_vocab: int) -> np.ndarray:
    """[model_vocab] float32 bytes spelled by each id (0 for specials and padding ids): the
    denominator of bits per byte."""
    out = np.zeros(model_vocab, np.float32)
    for i, b in enumerate(token_bytes(tok)[:model_vocab]):
        out[i] = 0 if b is None else len(b)
    return out


@dataclass(frozen=True, eq=False)
class VocabMap:
    """Which student id each teacher id is, where one spells the same bytes.

    `student_of` [Vt] int32: the student id of each teacher id, or -1 (no student token
    spells it, or another teacher id already took that student id: the map is one to one,
    so the mapped teacher log-probs are a gather, exact, never a sum). `teacher_of` [Vs]
    int32: the inverse, -1 where no teacher id maps there. Specials map by role. Both are
    numpy constants of the compiled step; equality and hash go by their contents, so equal
    maps share a compiled program (`distill.programs`).
    """

    student_of: np.ndarray
    teacher_of: np.ndarray

    @classmethod
    def between(
        cls, teacher: Tokenizer, student: Tokenizer, teacher_vocab: int, student_vocab: int
    ) -> VocabMap:
        """The map from `teacher`'s ids (a model vocabulary of `teacher_vocab`) to
        `student`'s (of `student_vocab`)."""
        by_text: dict[bytes, int] = {}
        for i, b in enumerate(token_bytes(student)[:student_vocab]):
            if b is not None and b not in by_text:
                by_text[b] = i
        student_of = np.full(teacher_vocab, -1, np.int32)
        teacher_of = np.full(student_vocab, -1, np.int32)
        pairs = [(getattr(teacher, r), getattr(student, r)) for r in ("bos_id", "eos_id", "pad_id")]
        pairs += [
            (i, by_text.get(b))
            for i, b in enumerate(token_bytes(teacher)[:teacher_vocab])
            if b is not None
        ]
        for t, s in pairs:
            if t is None or s is None or not (0 <= t < teacher_vocab and 0 <= s < student_vocab):
                continue
            if student_of[t] < 0 and teacher_of[s] < 0:
                student_of[t], teacher_of[s] = s, t
        return cls(student_of, teacher_of)

    @property
    def identity(self) -> bool:
        """Whether every id maps to itself (the same tokenizer on both sides)."""
        n = len(self.student_of)
        return n == len(self.teacher_of) and bool(np.all(self.student_of == np.arange(n)))

    def coverage(self) -> tuple[float, float]:
        """(share of teacher ids mapped, share of student ids mapped)."""
        return float(np.mean(self.student_of >= 0)), float(np.mean(self.teacher_of >= 0))

    def _key(self) -> tuple[bytes, bytes]:
        return self.student_of.tobytes(), self.teacher_of.tobytes()

    def __eq__(self, other) -> bool:
        return isinstance(other, VocabMap) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True, eq=False)
class FirstBytes:
    """The bucket of each id by the first byte it spells (0-255; BOS, EOS, PAD: 256-258),
    for teacher and student; -1 for ids that spell nothing. Both distributions summed
    into these buckets are the next byte's distribution (and the specials'), whatever the
    vocabularies: for a byte-level teacher, its own distribution exactly. Equality and
    hash go by contents, as `VocabMap`'s.

    `follows` [Vs, size] bool, or None: the buckets a student token's successor starts
    with somewhere in the training text (`after_tokens`). A byte-level teacher predicts the
    next byte from the text alone; at a student token boundary the tokenizer has already
    said something about it (byte-level BPE keeps a word's leading space in the word's
    token, so a token of spaces is followed by a space), and the loss keeps the teacher's
    mass to the buckets that can follow the student's current token."""

    teacher: np.ndarray
    student: np.ndarray
    follows: np.ndarray | None = None
    size = 259

    @classmethod
    def between(
        cls, teacher: Tokenizer, student: Tokenizer, teacher_vocab: int, student_vocab: int
    ) -> FirstBytes:
        return cls(_first_bytes(teacher, teacher_vocab), _first_bytes(student, student_vocab))

    def after_tokens(self, stream: np.ndarray, doc_start: np.ndarray) -> FirstBytes:
        """These buckets with `follows` read from a packed student stream [n] (its ids)
        and its document-start flags [n]: each id's successors in the same document."""
        nxt = self.student[stream[1:]]
        seen = (nxt >= 0) & ~doc_start[1:]
        follows = np.zeros((len(self.student), self.size), bool)
        follows[stream[:-1][seen], nxt[seen]] = True
        return replace(self, follows=follows)

    def _key(self) -> tuple[bytes, ...]:
        after = b"" if self.follows is None else np.packbits(self.follows).tobytes()
        return self.teacher.tobytes(), self.student.tobytes(), after

    def __eq__(self, other) -> bool:
        return isinstance(other, FirstBytes) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _first_bytes(tok: Tokenizer, model_vocab: int) -> np.ndarray:
    out = np.full(model_vocab, -1, np.int32)
    for i, b in enumerate(token_bytes(tok)[:model_vocab]):
        if b:
            out[i] = b[0]
    for n, i in enumerate((tok.bos_id, tok.eos_id, tok.pad_id)):
        if i is not None and i < model_vocab:
            out[i] = 256 + n
    return out
