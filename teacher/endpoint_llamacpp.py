"""llama-cpp-python's server (`teacher.endpoint.api: llamacpp`): its completions API with
`echo` and `logprobs`, read into distill's convention (position i of a row holds the top-k
of the distribution of the token after i).

What that server does, read from llama-cpp-python 0.3.36's `Llama._create_completion` and
checked by `probe` against the server itself before any batch:

- a prompt is text, one per request (a prompt of token ids fails with `echo`), tokenised by
  the server (`special=True`: "<s>" is the BOS); the client writes each document's ids as
  text and checks the ids the server echoes back;
- its echo lists the prompt's tokens from the second on when the first is its BOS, from the
  first otherwise, and the listing's entry j holds the distribution *after* prompt token j
  in both cases (so for a document without a BOS each token is listed with the distribution
  after it, one position off vLLM's `prompt_logprobs`; with a BOS they line up); entry 0 is
  always null. That is distill's position j, for j >= 1;
- position 0 (the distribution after a document's first token) comes from a request without
  echo whose prompt is that token alone: its one generated token is listed with the
  distribution after the prompt. It is the same for every document that starts with that
  token, and asked once;
- entries are keyed by the token's text (`detokenize`), not its id: the client asks the
  server for the text of every id once (`/extras/detokenize`) and reads keys through that
  table; a key that several ids share is refused when it is met;
- the generated token is drawn after the prompt; a `logit_bias` keeps it off the EOS (which
  ends a completion before it is listed) and the BOS (left out of every listing). The bias
  acts on the sampler's copy of the logits, not on the listed log-probs.

A server that puts a BOS of its own before every text prompt (a GGUF whose
`tokenizer.ggml.add_bos_token` is true) lists nothing for the first position of a document
that starts with a BOS (its echo's entry 0 is null and a prompt of nothing lists nothing):
the probe refuses it, naming the flag that turns it off.
"""

from __future__ import annotations

import threading

import numpy as np

from distill.observability.metrics_log import dumps
from teacher.endpoint_apis import Answer, BadResponse, _json, pieces, top_of


class LlamaCpp:
    """The `llamacpp` API: `probe(post)` once, then `ask(rows, post) -> Answer` per request
    of rows; `post(path, body) -> bytes` is the client's (retries included)."""

    path = "/v1/completions"
    content_type = "application/json"

    def __init__(self, k: int, vocab: int, model: str | None, tokenizer):
        self.k, self.vocab, self.model, self.tok = k, vocab, model, tokenizer
        self.bos, self.eos = tokenizer.bos_id, tokenizer.eos_id
        self.adds_bos = False  # refused by `probe`; read by the client's warning
        self._text: list[str] = []  # id -> the server's text of it
        self._ids: dict[str, int] = {}  # text -> id, texts several ids share left out
        self._after: dict[int, tuple] = {}  # id -> top-k after that token alone
        self._lock = threading.Lock()

    # -- the server's vocabulary and convention, once

    def probe(self, post) -> None:
        """Learn the server's text of every id, refuse a server that adds its own BOS, and
        check on a short prompt that the echo's entry j is the distribution after token j
        (with and without a leading BOS)."""
        self._text = [self._detokenize(post, i) for i in range(self.vocab)]
        seen: dict[str, int] = {}
        for i, text in enumerate(self._text):
            seen[text] = -1 if text in seen else i
        self._ids = {t: i for t, i in seen.items() if i >= 0}
        plain = [int(i) for i in self.tok.encode("the teacher and the student")[:3]]
        if len(plain) < 3:
            raise BadResponse("data.tokenizer gives fewer than 3 ids for a probe sentence")
        got = self._tokenize(post, self.tok.decode(plain[:1]))
        if len(got) > 1 and got[1:] == plain[:1]:
            self.adds_bos = True
            raise BadResponse(
                f"it puts its own BOS (id {got[0]}) before every prompt and then lists no "
                "distribution for a document's first position; start it with --kv_overrides "
                "tokenizer.ggml.add_bos_token=bool:false"
            )
        if self.bos is not None and self._text[self.bos]:
            if self._tokenize(post, self._text[self.bos]) != [self.bos]:
                raise BadResponse(
                    f"its text of the BOS ({self._text[self.bos]!r}) does not tokenise back to "
                    f"id {self.bos}"
                )
            self._check(post, [self.bos, *plain[:2]])
        self._check(post, plain)

    def _check(self, post, ids: list[int]) -> None:
        """The echo of `ids` at position 1 equals the top-k after ids[:2] alone."""
        lps, ids_at = self._echo(post, ids, row=0, start=0)
        want = self._after_prompt(post, ids[:2], (0, 1))
        got = ids_at.get(1)
        if got is None or got[1] != want[1] or not np.allclose(got[0], want[0], atol=1e-3):
            raise BadResponse(
                f"its echo of the prompt {ids} lists at entry 1 {got and got[1]}, not the "
                f"distribution after its first two tokens ({want[1]}): a convention not read "
                "here (read from llama-cpp-python 0.3.36)"
            )

    # -- one request of rows

    def ask(self, rows, post) -> Answer:
        """The top-k of rows (tokens, targets, segment ids, positions, mask [R, S]) at their
        positions to learn: one echo request per document, and position 0 from `_after`."""
        n, length = np.shape(rows[0])
        lp = np.zeros((n, length, self.k), np.float32)
        ids = np.zeros((n, length, self.k), np.int32)
        have = np.zeros((n, length), bool)
        for p in pieces(rows[0], rows[1], rows[2], rows[4]):
            m = len(p.ids)  # positions start .. start + m - 2 are learned
            first = self._after_one(post, int(p.ids[0]), (p.row, p.start))
            lp[p.row, p.start], ids[p.row, p.start] = first
            have[p.row, p.start] = True
            if m > 2:  # the last id is only ever predicted: not sent
                _, at = self._echo(post, [int(i) for i in p.ids[: m - 1]], p.row, p.start)
                for q in range(1, m - 1):
                    if q not in at:
                        raise BadResponse("no log-probs at this position", p.row, p.start + q)
                    lp[p.row, p.start + q], ids[p.row, p.start + q] = at[q]
                    have[p.row, p.start + q] = True
        return Answer(lp, ids, have)

    def _after_one(self, post, token: int, where: tuple) -> tuple:
        with self._lock:
            if token in self._after:
                return self._after[token]
        top = self._after_prompt(post, [token], where)
        with self._lock:
            self._after[token] = top
        return top

    # -- the server's endpoints

    def _echo(self, post, sent: list[int], row: int, start: int) -> tuple[list, dict]:
        """Echo `sent` as text: (the listed ids, {position: (log-probs, ids) top-k})."""
        where = (row, start)
        choice = self._complete(post, self._prompt(sent, where), echo=True)
        lps = choice.get("logprobs")
        if not isinstance(lps, dict) or not isinstance(lps.get("tokens"), list) or \
                not isinstance(lps.get("top_logprobs"), list):  # fmt: skip
            raise BadResponse("a choice without logprobs.tokens and top_logprobs", *where)
        listed = [self._id(t, where) for t in lps["tokens"]]
        lead = int(self.bos is not None and sent[0] == self.bos)
        expect = sent[lead:]
        for j, want in enumerate(expect):
            got = listed[j] if j < len(listed) else None
            if got != want:
                raise BadResponse(
                    f"the server's token {got} where the batch has {want}: it tokenises "
                    "differently from data.tokenizer", row, start + j + lead,
                )  # fmt: skip
        out = {}
        for j, entry in enumerate(lps["top_logprobs"][: len(sent)]):
            if j == 0 or entry is None:
                continue
            out[j] = self._top(entry, (row, start + j))
        return listed, out

    def _after_prompt(self, post, sent: list[int], where: tuple) -> tuple:
        """The top-k of the distribution after `sent` (a request without echo)."""
        choice = self._complete(post, self._prompt(sent, where), echo=False)
        lps = choice.get("logprobs")
        tops = lps.get("top_logprobs") if isinstance(lps, dict) else None
        if not isinstance(tops, list) or len(tops) != 1 or not isinstance(tops[0], dict):
            raise BadResponse("no log-probs for the token generated after the prompt", *where)
        return self._top(tops[0], where)

    def _complete(self, post, text: str, echo: bool) -> dict:
        body = {"prompt": text, "echo": echo, "logprobs": self.k, "max_tokens": 1,
                "temperature": 0.0, "logit_bias": {str(i): -100.0 for i in
                                                  {self.bos, self.eos} - {None}}}  # fmt: skip
        if self.model is not None:
            body["model"] = self.model
        answer = _json(post(self.path, dumps(body).encode()))
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise BadResponse("the body has no list of 1 choice")
        return choices[0]

    def _detokenize(self, post, i: int) -> str:
        answer = _json(post("/extras/detokenize", dumps({"tokens": [i]}).encode()))
        if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
            raise BadResponse(f"/extras/detokenize gave no text for id {i}")
        return answer["text"]

    def _tokenize(self, post, text: str) -> list[int]:
        answer = _json(post("/extras/tokenize", dumps({"input": text}).encode()))
        if not isinstance(answer, dict) or not isinstance(answer.get("tokens"), list):
            raise BadResponse("/extras/tokenize gave no tokens")
        return answer["tokens"]

    # -- ids and texts

    def _prompt(self, sent: list[int], where: tuple) -> str:
        """`sent` as text the server tokenises back to it: a special id (BOS, EOS, PAD) as
        the server's text of it, every run of other ids as data.tokenizer decodes it."""
        specials = {self.bos, self.eos, getattr(self.tok, "pad_id", None)} - {None}
        parts, run = [], []
        for at, i in enumerate(sent):
            if i not in specials:
                run.append(i)
                continue
            if run:
                parts.append(self.tok.decode(run))
                run = []
            if not self._text[i]:
                raise BadResponse(
                    f"token {i} has no text on the server, so it cannot be sent in a text "
                    "prompt", where[0], where[1] + at,
                )  # fmt: skip
            parts.append(self._text[i])
        if run:
            parts.append(self.tok.decode(run))
        return "".join(parts)

    def _id(self, key, where: tuple) -> int:
        if isinstance(key, str) and key in self._ids:
            return self._ids[key]
        raise BadResponse(f"token {key!r} names no single id of the server's vocabulary", *where)

    def _top(self, entry, where: tuple) -> tuple:
        if not isinstance(entry, dict):
            raise BadResponse("a top_logprobs entry that is not an object", *where)
        return top_of([(v, self._id(t, where)) for t, v in entry.items()], self.k, self.vocab,
                      where)  # fmt: skip
