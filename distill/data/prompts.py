"""On-policy prompts from a field of the data's records (`data.prompt_field`).

With `data.prompt_field` set, the on-policy steps continue prompts read from that field of
the JSONL records (or that column of the Parquet files) of `data.source`, instead of the
first `distill.on_policy.prompt_len` tokens of the data's rows. Each prompt is one
document's start, `[BOS] + tokens`, cut to its last `prompt_len` tokens and left-padded
with segment 0 (`distill.types.Prompts`). Step n's prompts are batch n of the prompts in an
order shuffled by the run seed, cycling: a function of the step, so a resume takes the same.

Chat data (`data.format: chat`) always takes its prompts from its conversations: each one
up to its last assistant turn, rendered with the template's generation prompt and no BOS
of ours (the template writes its own); the student answers from there and stops at EOS,
which the tokenizer_config.json of an instruct model names as its end-of-turn token.
"""

from __future__ import annotations

import numpy as np

from distill.config import DataConfig
from distill.data.examples import conversation_prompts
from distill.data.loader import record_texts, resolve_paths
from distill.data.tokenizers import Tokenizer
from distill.errors import DistillError
from distill.types import Prompts


def load_prompts(cfg: DataConfig) -> list[str]:
    """The non-empty `data.prompt_field` strings of data.source, in sorted path order."""
    field, prompts = cfg.prompt_field, []
    for path in resolve_paths(cfg):
        prompts.extend(t for t in record_texts(path, cfg, field, "data.prompt_field") if t)
    if not prompts:
        raise DistillError(f"data.prompt_field: no record of '{cfg.source}' has a '{field}'")
    return prompts


class PromptSet:
    """Tokenised prompts, [N, prompt_len] each field; `batch(step, rows)` is step's."""

    def __init__(self, texts: list[str], tokenizer: Tokenizer, prompt_len: int, seed: int):
        bos = [tokenizer.bos_id]
        docs = [
            np.concatenate([bos, ids]).astype(np.int32) for ids in tokenizer.encode_batch(texts)
        ]
        self._fill(docs, prompt_len, seed)

    @classmethod
    def of_ids(cls, docs: list[np.ndarray], prompt_len: int, seed: int) -> PromptSet:
        """Prompts already tokenised whole ([n] int32 each, nothing added)."""
        self = cls.__new__(cls)
        self._fill(docs, prompt_len, seed)
        return self

    def _fill(self, docs: list[np.ndarray], prompt_len: int, seed: int) -> None:
        n = len(docs)
        self.tokens = np.zeros((n, prompt_len), np.int32)
        self.segment_ids = np.zeros((n, prompt_len), np.int32)
        self.positions = np.zeros((n, prompt_len), np.int32)
        for i, doc in enumerate(docs):
            first = max(len(doc) - prompt_len, 0)  # cut: keep the prompt's end
            kept = doc[first:]
            self.tokens[i, prompt_len - len(kept) :] = kept
            self.segment_ids[i, prompt_len - len(kept) :] = 1
            self.positions[i, prompt_len - len(kept) :] = np.arange(first, len(doc))
        self._order = np.random.default_rng([seed % 2**32, 0x9E3779B9]).permutation(n)

    def batch(self, step: int, rows: int) -> Prompts:
        idx = self._order[(np.arange(rows) + (step - 1) * rows) % len(self._order)]
        return Prompts(self.tokens[idx], self.segment_ids[idx], self.positions[idx])


def prompt_set(cfg, tokenizer: Tokenizer) -> PromptSet | None:
    """The run's prompts: of chat data's conversations, or of `data.prompt_field` when set
    (else None: the rows' prefixes)."""
    prompt_len, _ = cfg.distill.on_policy.lengths(cfg.train.seq_len)
    if cfg.data.format == "chat":
        texts = conversation_prompts(cfg.data, resolve_paths(cfg.data), tokenizer)
        if not texts:
            raise DistillError(f"data.source: no conversation of '{cfg.data.source}' to prompt")
        docs = [ids for ids, _ in tokenizer.encode_offsets(texts)]
        return PromptSet.of_ids(docs, prompt_len, cfg.run.seed)
    if cfg.data.prompt_field is None:
        return None
    return PromptSet(load_prompts(cfg.data), tokenizer, prompt_len, cfg.run.seed)


def answer_prompts(batch, prompt_len: int) -> Prompts:
    """Prompts [B, prompt_len] of rows of examples (chat, pairs): each row's tokens up to
    the one that predicts its first trained target (the first answer's start, after the
    template's generation prompt), cut to the last ``prompt_len`` and left-padded."""
    mask = np.asarray(batch.mask) > 0
    tokens, seg, pos = (np.asarray(x) for x in (batch.tokens, batch.segment_ids, batch.positions))
    b = mask.shape[0]
    out = [np.zeros((b, prompt_len), np.int32) for _ in range(3)]
    for i in range(b):
        end = int(np.argmax(mask[i])) + 1 if mask[i].any() else int((seg[i] > 0).sum())
        lo = max(end - prompt_len, 0)
        n = end - lo
        for dst, src in zip(out, (tokens, seg, pos), strict=True):
            dst[i, prompt_len - n :] = src[i, lo:end]
    return Prompts(*out)
