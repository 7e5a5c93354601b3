"""The JSON APIs of `distill serve`, as the servers distill clients talk to write them.

Each parses a request body into prompts (int32 ids [n] each) and formats the scored rows
(`pipelines.serve.scorer.Scored`) back. Their position conventions differ from distill's
(where position i holds the distribution of token i + 1):

- OpenAI completions with `echo` and `logprobs: k` (vLLM's, llama.cpp's servers):
  `logprobs.top_logprobs[i]` is the distribution token i was drawn from, keyed by token
  string; entry 0 is None. `return_tokens_as_token_ids` (vLLM's) writes each token as
  `token_id:N`, so the keys name ids exactly.
- vLLM's `prompt_logprobs: k`: `choices[j].prompt_logprobs[i]` likewise, keyed by id, each
  `{"logprob", "rank", "decoded_token"}`, with the prompt token's own entry; entry 0 None.
- SGLang's `/generate` with `return_logprob`, `logprob_start_len: 0`, `top_logprobs_num: k`:
  `meta_info.input_top_logprobs[i]` likewise, as `[logprob, id, text]` triples.

`max_tokens` (`max_new_tokens`) may be 0, or 1 for the greedy next token (servers that
refuse 0); nothing longer is generated.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from distill.data.tokenizers import Tokenizer
from pipelines.serve.scorer import Scored


class BadRequest(ValueError):
    """A request the API refuses (HTTP 400), with the reason."""


def prompts_of(body: dict, tok: Tokenizer, vocab: int, key: str = "prompt") -> list[np.ndarray]:
    """The prompts of a body's `key`: a text, token ids, or a list of either. A text is
    tokenised with the tokenizer's BOS first, as distill packs documents."""
    value = body.get(key)
    if isinstance(value, str) or (isinstance(value, list) and value and _is_ids(value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{key}: a text, a list of token ids, or a non-empty list of them")
    out = []
    for p in value:
        if isinstance(p, str):
            ids = np.concatenate([[tok.bos_id], tok.encode(p)]).astype(np.int32)
        elif isinstance(p, list) and p and _is_ids(p):
            ids = np.asarray(p, np.int64)
        else:
            raise BadRequest(f"{key}: each prompt is a text or a non-empty list of token ids")
        if ids.min() < 0 or ids.max() >= vocab:
            raise BadRequest(f"{key}: token ids must lie in [0, {vocab})")
        out.append(ids.astype(np.int32))
    return out


def _is_ids(value: list) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def int_field(body: dict, key: str, default, low: int, high: int) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"{key}: an integer in [{low}, {high}]")
    return value


def extended(prompts: list[np.ndarray], scored: list[Scored], new: int) -> list[np.ndarray]:
    """Each prompt with its `new` (0 or 1) greedy next tokens."""
    return [
        np.concatenate([p, s.ids[-1:, 0]]) if new else p
        for p, s in zip(prompts, scored, strict=True)
    ]


def _entries(s: Scored, ids: np.ndarray, k: int) -> list[tuple[float, list, list]]:
    """Per token i of `ids` (a prompt and its new tokens): (its log-prob, the top-k ids and
    log-probs of the distribution it came from), i >= 1; at the prompt's length the last
    position's output predicts the new token."""
    out = []
    for i in range(1, len(ids)):
        lp, top = s.logprobs[i - 1, :k], s.ids[i - 1, :k]
        hit = np.nonzero(s.ids[i - 1] == ids[i])[0]
        own = float(s.logprobs[i - 1, hit[0]]) if len(hit) else None
        if own is None and s.next_logprobs is not None and i < len(s.next_logprobs):
            own = float(s.next_logprobs[i - 1])
        out.append((own, top.tolist(), lp.tolist()))
    return out


def openai_choice(
    tok: Tokenizer, s: Scored, ids: np.ndarray, n_prompt: int, body: dict, k: int | None, index
) -> dict:
    """One `choices` entry of a completions response."""
    echo, as_ids = bool(body.get("echo")), bool(body.get("return_tokens_as_token_ids"))
    name = (lambda i: f"token_id:{i}") if as_ids else (lambda i: tok.decode([i]))
    first = 0 if echo else n_prompt
    choice: dict[str, Any] = {
        "index": index,
        "text": tok.decode(ids[first:]) if echo else tok.decode(ids[n_prompt:]),
        "logprobs": None,
        "finish_reason": "length",
        "prompt_token_ids": ids[:n_prompt].tolist(),
    }
    entries = _entries(s, ids, max(k or 0, body.get("prompt_logprobs") or 0, 1))
    if k is not None:
        shown = list(range(first, len(ids)))
        tokens = [name(int(ids[i])) for i in shown]
        offsets = np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist() if tokens else []
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": [None if i == 0 else entries[i - 1][0] for i in shown],
            "top_logprobs": [
                None
                if i == 0
                else {name(t): v for t, v in zip(*(e[:k] for e in entries[i - 1][1:]), strict=True)}
                for i in shown
            ],
            "text_offset": offsets,
        }
    pk = body.get("prompt_logprobs")
    if pk is not None:
        choice["prompt_logprobs"] = [None] + [
            _vllm_entry(tok, int(ids[i]), *entries[i - 1], pk) for i in range(1, n_prompt)
        ]
    return choice


def _vllm_entry(tok: Tokenizer, own_id: int, own: float | None, top: list, lps: list, k: int):
    entry = {
        str(t): {"logprob": v, "rank": r + 1, "decoded_token": tok.decode([t])}
        for r, (t, v) in enumerate(zip(top[:k], lps[:k], strict=True))
    }
    if str(own_id) not in entry:
        rank = top.index(own_id) + 1 if own_id in top else None
        entry[str(own_id)] = {"logprob": own, "rank": rank, "decoded_token": tok.decode([own_id])}
    return entry


def completion_response(model: str, choices: list[dict], prompt_tokens: int, new: int) -> dict:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": new,
            "total_tokens": prompt_tokens + new,
        },
    }


def sglang_result(tok: Tokenizer, s: Scored, ids: np.ndarray, k: int, text: bool) -> dict:
    """One prompt's `/generate` answer, with every prompt position's log-probs."""
    word = (lambda t: tok.decode([t])) if text else (lambda t: None)
    entries = _entries(s, ids, max(k, 1))
    own = [[None, int(ids[0]), word(int(ids[0]))]]
    own += [[e[0], int(ids[i + 1]), word(int(ids[i + 1]))] for i, e in enumerate(entries)]
    top = [None] + [
        [[v, t, word(t)] for t, v in zip(e[1][:k], e[2][:k], strict=True)] if k else []
        for e in entries
    ]
    return {
        "text": "",
        "meta_info": {
            "id": uuid.uuid4().hex,
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "finish_reason": {"type": "length", "length": 0},
            "input_token_logprobs": own,
            "input_top_logprobs": top,
            "output_token_logprobs": [],
            "output_top_logprobs": [],
        },
    }
