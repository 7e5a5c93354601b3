"""The served teacher: rows of token ids in, top-k log-probs (and the log-prob of each
row's next token) out, one `OnlineTeacher` output per batch of rows.

Rows arrive with different lengths; a batch is padded to a length bucket (a power of two
from 16) and to a fixed count of rows, so the teacher compiles one program per bucket.
Padding rows and positions have segment id 0: they attend to nothing of a real row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from distill.config import Config
from distill.data.tokenizers import Tokenizer, vocab_limit
from distill.errors import DistillError
from distill.types import Batch
from teacher.forward import forward_for, make_output_forward
from teacher.online import OnlineTeacher

MIN_BUCKET = 16


class Row(NamedTuple):
    """One row to score: int32 tokens, segment ids and positions [L]."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    @classmethod
    def prompt(cls, ids) -> Row:
        """A whole prompt: one segment from position 0."""
        ids = np.asarray(ids, np.int32)
        return cls(ids, np.ones_like(ids), np.arange(len(ids), dtype=np.int32))


class Scored(NamedTuple):
    """A row's outputs: top-k log-probs and ids [L, k] at distill's positions (position i:
    the distribution of the token after i), and the log-prob of each next token [L]
    (`tokens[i + 1]`; the last is 0.0, there being none)."""

    logprobs: np.ndarray
    ids: np.ndarray
    next_logprobs: np.ndarray | None


def bucket(length: int) -> int:
    """The padded length of a batch whose longest row has `length` tokens."""
    return max(MIN_BUCKET, 1 << (max(length, 1) - 1).bit_length())


def check_servable(cfg: Config) -> None:
    """What `distill serve` needs of the config, before any device work."""
    if cfg.teacher.top_k is None:
        raise DistillError(
            "teacher.top_k: distill serve answers top-k log-probs; set the largest k a client "
            "may ask for (vLLM caps it at 20 by default)"
        )


class Scorer:
    """The teacher behind `distill serve`: `score(rows, targets, temperature)` runs one
    batch. The weights are the `OnlineTeacher`'s; its top-k forward is built once for each
    temperature asked for (the JSON APIs' is 1, distill clients send their own)."""

    def __init__(self, cfg: Config, mesh, tokenizer: Tokenizer, rows: int):
        self.teacher = OnlineTeacher(cfg, mesh, tokenizer)
        self._cfg, self.top_k = cfg, cfg.teacher.top_k
        mcfg = cfg.teacher.model
        self._limit = vocab_limit(tokenizer, mcfg.vocab_size)
        self.vocab = self._limit or mcfg.vocab_size
        self.rows = -(-rows // mesh.devices.size) * mesh.devices.size  # rows split evenly
        self._topk: dict[float, object] = {}
        self._next = forward_for(
            mcfg,
            mesh,
            mode="target_logprobs",
            dtype=cfg.teacher.dtype,
            vocab_limit=vocab_limit(tokenizer, mcfg.vocab_size),
            microbatch=cfg.teacher.microbatch,
        )

    def score(self, rows: list[Row], targets: bool, temperature: float = 1.0) -> list[Scored]:
        """The outputs of up to `self.rows` rows at `temperature`; with `targets`, each next
        token's log-prob (at temperature 1)."""
        placed = jax.device_put(self._batch(rows), self.teacher.put)
        out = self._forward(temperature)(self.teacher.params, placed)
        out = out[0] if self.teacher.moe else out  # (output, expert load)
        logprobs, ids = np.asarray(out.logprobs), np.asarray(out.ids)
        nxt = None
        if targets:
            nxt = np.asarray(self._next(self.teacher.params, placed))
        return [
            Scored(
                logprobs[r, : len(row.tokens)],
                ids[r, : len(row.tokens)],
                None if nxt is None else _last_zero(nxt[r, : len(row.tokens)]),
            )
            for r, row in enumerate(rows)
        ]

    def _forward(self, temperature: float):
        if temperature not in self._topk:
            cfg = self._cfg.model_copy(deep=True)
            cfg.distill.temperature = temperature
            moe = self.teacher.moe
            self._topk[temperature] = make_output_forward(cfg, self.teacher.mesh, self._limit, moe)
        return self._topk[temperature]

    def _batch(self, rows: list[Row]) -> Batch:
        length = bucket(max(len(r.tokens) for r in rows))
        shape = (self.rows, length)
        tokens, targets = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        segments, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        for r, row in enumerate(rows):
            n = len(row.tokens)
            tokens[r, :n], segments[r, :n], positions[r, :n] = row
            targets[r, : n - 1] = row.tokens[1:]
        mask = (segments > 0).astype(np.float32)
        return Batch(tokens, targets, segments, positions, mask)


def _last_zero(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    x[-1] = 0.0
    return x
