"""The student's vocabulary as a trie of byte prefixes, for the byte-path loss.

A student's next-token distribution, read byte by byte along the token it is trained to
predict, factors into conditional next-byte distributions: after the first d bytes of that
token, the share of the probability of the tokens starting with those d bytes that goes
on with each byte, plus the share of the token that is exactly those d bytes ("ends
here"). A byte-level teacher predicts each of those bytes at its own position, so the two
compare byte by byte (`distill.models.cross.losses.byte_path_divergence`). The tables here
are numpy constants of the compiled step, built once per run:

- `path` [Vs, D + 1]: the trie node of each student id's first d bytes (node 0: none),
  -1 past the id's length (and for ids that spell nothing); D, the longest token kept;
- `child` [N, 256]: the node of a node's prefix followed by each byte, -1 where no student
  token starts with it;
- `ends` [N]: the student id that spells exactly a node's prefix, -1 where none does;
- `pair_id`, `pair_node` [P]: every (id, node) with the node a prefix of the id (the id
  included), for the probability of the tokens under each node as one segment sum;
- `teacher_byte` [256]: the teacher's id of each single byte, -1 where it has none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from distill.data.token_bytes import FirstBytes, token_bytes
from distill.data.tokenizers import Tokenizer

MAX_DEPTH = 16  # bytes of a token followed at most; a longer token's tail is not compared


@dataclass(frozen=True, eq=False)
class BytePaths:
    """The trie tables of a student vocabulary against a byte-level teacher (see the module
    docstring), with the first-byte buckets of depth 0. Equality and hash by contents."""

    first: FirstBytes
    path: np.ndarray
    child: np.ndarray
    ends: np.ndarray
    pair_id: np.ndarray
    pair_node: np.ndarray
    teacher_byte: np.ndarray

    @property
    def depth(self) -> int:
        return self.path.shape[1] - 1

    @classmethod
    def between(
        cls, teacher: Tokenizer, student: Tokenizer, teacher_vocab: int, student_vocab: int
    ) -> BytePaths:
        spelled = token_bytes(student)[:student_vocab]
        depth = min(MAX_DEPTH, max((len(b) for b in spelled if b), default=1))
        nodes: dict[bytes, int] = {b"": 0}
        for b in spelled:
            for d in range(1, len(b or b"") + 1):
                nodes.setdefault(b[:d], len(nodes))
        path = np.full((student_vocab, depth + 1), -1, np.int32)
        child = np.full((len(nodes), 256), -1, np.int32)
        ends = np.full(len(nodes), -1, np.int32)
        pair_id, pair_node = [], []
        for prefix, n in nodes.items():
            if prefix:
                child[nodes[prefix[:-1]], prefix[-1]] = n
        for i, b in enumerate(spelled):
            if not b:
                continue
            if ends[nodes[b]] < 0:
                ends[nodes[b]] = i
            for d in range(len(b) + 1):
                pair_id.append(i), pair_node.append(nodes[b[:d]])
                if d <= depth:
                    path[i, d] = nodes[b[:d]]
        teacher_byte = np.full(256, -1, np.int32)
        for i, b in enumerate(token_bytes(teacher)[:teacher_vocab]):
            if b is not None and len(b) == 1 and teacher_byte[b[0]] < 0:
                teacher_byte[b[0]] = i
        first = FirstBytes.between(teacher, student, teacher_vocab, student_vocab)
        arrays = (path, child, ends, np.asarray(pair_id, np.int32), np.asarray(pair_node, np.int32))
        return cls(first, *arrays, teacher_byte)

    def after_tokens(self, stream: np.ndarray, doc_start: np.ndarray) -> BytePaths:
        """These tables with depth 0 conditioned on the student's token boundary
        (`FirstBytes.after_tokens`)."""
        return replace(self, first=self.first.after_tokens(stream, doc_start))

    def _key(self) -> tuple:
        return (self.first._key(), *(a.tobytes() for a in (self.path, self.child, self.ends)))

    def __eq__(self, other) -> bool:
        return isinstance(other, BytePaths) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())
