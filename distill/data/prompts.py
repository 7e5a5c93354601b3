"""On-policy prompts from a field of the data's records (`data.prompt_field`).

With `data.prompt_field` set, the on-policy steps continue prompts read from that field of
the JSONL records (or that column of the Parquet files) of `data.source`, instead of the
first `distill.on_policy.prompt_len` tokens of the data's rows. Each prompt is one
document's start, `[BOS] + tokens`, cut to its last `prompt_len` tokens and left-padded
with segment 0 (`distill.types.Prompts`). Step n's prompts are batch n of the prompts in an
order shuffled by the run seed, cycling: a function of the step, so a resume takes the same.
"""

from __future__ import annotations

import numpy as np

from distill.config import DataConfig
from distill.data.pipeline import record_texts, resolve_paths
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
        n = len(texts)
        self.tokens = np.zeros((n, prompt_len), np.int32)
        self.segment_ids = np.zeros((n, prompt_len), np.int32)
        self.positions = np.zeros((n, prompt_len), np.int32)
        for i, ids in enumerate(tokenizer.encode_batch(texts)):
            doc = np.concatenate([[tokenizer.bos_id], ids]).astype(np.int32)
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
    """The run's prompts when `data.prompt_field` is set (else None: the rows' prefixes)."""
    if cfg.data.prompt_field is None:
        return None
    prompt_len, _ = cfg.distill.on_policy.lengths(cfg.train.seq_len)
    return PromptSet(load_prompts(cfg.data), tokenizer, prompt_len, cfg.run.seed)
