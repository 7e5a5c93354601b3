"""The request and response formats of the servers an endpoint teacher asks
(`teacher.endpoint`), each turned into distill's convention: position i of a row holds the
top-k of the distribution of the token after i (`distill.types.TeacherOutput`).

A packed row holds several documents (segment ids), and the JSON APIs score one prompt
from position 0, so each document of a row goes out as a prompt of its own: its tokens,
and its next token when the row's last target still belongs to it. Those APIs list, at
prompt index j >= 1, the distribution prompt token j was drawn from (entry 0 is None): the
distribution distill keeps at the document's position j - 1. A server may leave out a
leading BOS it was sent (llama.cpp's echo does): its listing then starts at prompt index 1,
and is read so. One that puts a BOS of its own before every prompt is found out by a first,
two-token request (`_Json.probe`), which with the OpenAI API also checks that each entry is
the distribution its token was drawn from. The binary wire of `distill serve` answers
whole rows at distill's own positions. Every answer is checked: the ids the server echoes
are the batch's (the same tokenizer), every position asked for is there, finite, with at
least k ids in the vocabulary.
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

import numpy as np

from distill.observability.metrics_log import dumps
from teacher import wire


class BadResponse(ValueError):
    """An answer that is not a well-formed top-k one; the message names the row (of the
    request) and the position, or what is wrong with the whole body."""

    def __init__(self, message: str, row: int | None = None, position: int | None = None):
        super().__init__(message)
        self.row, self.position = row, position


class Piece(NamedTuple):
    """One prompt of a JSON request: row `row` of the request's rows, whose distill
    positions `start`, `start` + 1, ... its prompt indices 1, 2, ... give; `drop`: its
    leading ids not sent (a BOS the server adds itself)."""

    row: int
    start: int
    ids: np.ndarray  # int [m]
    drop: int = 0


class Answer(NamedTuple):
    """A request's top-k: per row of its rows, log-probs and ids [L, k] (float32, int32)
    and which positions they hold [L] bool."""

    logprobs: np.ndarray
    ids: np.ndarray
    have: np.ndarray


def pieces(tokens, targets, segment_ids, mask) -> list[Piece]:
    """The documents of rows [R, S] with a position to learn, as prompts (module docstring)."""
    out = []
    for r in range(len(tokens)):
        seg = np.asarray(segment_ids[r])
        edges = np.flatnonzero(np.diff(seg, prepend=-1, append=-1))
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            if seg[a] == 0 or not np.any(mask[r][a:b] > 0):
                continue
            ids = np.asarray(tokens[r][a:b])
            if mask[r][b - 1] > 0:  # the row's last target, of the same document
                ids = np.append(ids, targets[r][b - 1])
            out.append(Piece(r, int(a), ids.astype(np.int64)))
    return out


def top_of(entries: list[tuple[float, int]], k: int, vocab: int, where: tuple) -> tuple:
    """The k largest (log-prob, id) of one position, distill's order (ties: lower id first),
    checked: at least k, finite, ids in [0, vocab)."""
    if len(entries) < k:
        raise BadResponse(f"{len(entries)} log-probs where {k} were asked for", *where)
    for lp, i in entries:
        if not isinstance(lp, (int, float)) or math.isnan(lp) or lp > 1e-3 or lp == math.inf:
            raise BadResponse(f"log-prob {lp} is not a finite log-probability", *where)
        if not 0 <= i < vocab:
            raise BadResponse(f"token id {i} outside the vocabulary [0, {vocab})", *where)
    best = sorted(entries, key=lambda e: (-e[0], e[1]))[:k]
    if (mass := sum(math.exp(lp) for lp, _ in best)) > 1.001:
        raise BadResponse(f"top-k probabilities summing to {mass:.4f}, above 1", *where)
    return [max(lp, -1e30) for lp, _ in best], [i for _, i in best]


class _Json:
    """What the three JSON APIs share: a body of the pieces' prompts, and an answer
    assembled from each prompt's echoed ids and per-index entries."""

    path = "/v1/completions"
    content_type = "application/json"

    def __init__(self, k: int, vocab: int, model: str | None, bos_id: int | None, names=None):
        self.k, self.vocab, self.model, self.bos = k, vocab, model, bos_id
        self._names = names  # token string -> id, for servers that key entries by text
        self.adds_bos = False  # the server puts a BOS before every prompt (`probe`)
        self._listed_bos = False  # ... and lists it

    def body(self, batch_rows) -> tuple[bytes, list[Piece]]:
        """The request of rows (tokens, targets, segment ids, positions, mask [R, S]), and
        what reading its answer needs (its prompts)."""
        ps = pieces(batch_rows[0], batch_rows[1], batch_rows[2], batch_rows[4])
        if self.adds_bos:  # a document's own BOS is the one the server adds
            ps = [p._replace(drop=int(p.ids[0] == self.bos)) for p in ps]
        if not ps:
            return b"", ps
        return self._encode([p.ids[p.drop :].tolist() for p in ps]), ps

    def _encode(self, prompts: list) -> bytes:
        body = self._body(prompts)
        if self.model is not None:
            body["model"] = self.model
        return dumps(body).encode()  # strict JSON, as every body distill writes

    def probe(self, post) -> None:
        """Learn from one small request (`post(body) -> answer`) whether the server puts a
        BOS of its own before each prompt: then its first entry is not null (it was drawn
        after that BOS). A document that starts with a BOS is then sent without it."""
        first, second = [i for i in range(3) if i != self.bos][:2]
        sent = np.array([first, second])
        result = self._results(_json(post(self._encode([sent.tolist()]))), 1)[0]
        echoed, entries = self._read(result, Piece(0, 0, sent))
        if self.bos is not None and echoed[:1] == [self.bos] and echoed[1:3] == [first, second]:
            self._listed_bos = True
            echoed, entries = echoed[1:], entries[1:]
        _lead(echoed, sent, self.bos, 0, 0)
        self.adds_bos = bool(entries) and entries[0] is not None
        self._check_order(echoed, entries, len(sent))

    def _check_order(self, echoed: list[int], entries: list, n: int) -> None:
        """Whether each entry is the distribution its token was drawn from (the APIs other
        than OpenAI's define it so)."""

    def answer(self, raw: bytes, ps: list[Piece], batch_rows, k: int) -> Answer:
        """The top-k (the `k` largest) the body `raw` gives the rows' positions to learn."""
        rows, length = np.shape(batch_rows[0])
        lp = np.zeros((rows, length, k), np.float32)
        ids = np.zeros((rows, length, k), np.int32)
        have = np.zeros((rows, length), bool)
        results = self._results(_json(raw), len(ps))
        for p, result in zip(ps, results, strict=True):
            echoed, entries = self._read(result, p)
            if self._listed_bos:
                echoed, entries = echoed[1:], entries[1:]
            lead = _lead(echoed, p.ids[p.drop :], self.bos, p.row, p.start + p.drop)
            for at in range(p.start, p.start + len(p.ids) - 1):
                # the entry of sent id i is the distribution after ids[: drop + i]: position
                # start + drop + i - 1; the echo lists sent ids from `lead` on
                j = at - p.start - p.drop + 1 - lead
                e = entries[j] if 0 <= j < len(entries) else None
                if e is None:
                    raise BadResponse("no log-probs at this position", p.row, at)
                lp[p.row, at], ids[p.row, at] = top_of(e, k, self.vocab, (p.row, at))
                have[p.row, at] = True
        return Answer(lp, ids, have)

    _digits = False  # whether an entry's key may be an id written as text

    def _id(self, key, where: tuple) -> int:
        if isinstance(key, int) and not isinstance(key, bool):
            return key
        if isinstance(key, str) and key.startswith("token_id:"):
            tail = key.removeprefix("token_id:")
            if tail.isdigit():
                return int(tail)
        elif isinstance(key, str) and self._digits and key.isdigit():
            return int(key)
        elif isinstance(key, str) and self._names is not None and key in self._names():
            return self._names()[key]
        raise BadResponse(f"token {key!r} names no single id of data.tokenizer", *where)


class OpenAI(_Json):
    """/v1/completions with echo, logprobs: k, and vLLM's return_tokens_as_token_ids (a
    server without it keys its entries by token text, read through the tokenizer)."""

    def _body(self, prompts: list) -> dict:
        return {"prompt": prompts, "max_tokens": 1, "temperature": 0.0, "echo": True,
                "logprobs": self.k, "return_tokens_as_token_ids": True}  # fmt: skip

    def _results(self, body, n: int) -> list:
        return _choices(body, n)

    def _check_order(self, echoed: list[int], entries: list, n: int) -> None:
        """The entry of the greedy token after the prompt must have that token on top: each
        entry is then the distribution its token was drawn from (vLLM's order), not the one
        after it (llama-cpp-python's for a model without a BOS), which is not read."""
        if len(echoed) <= n or len(entries) <= n or entries[n] is None:
            raise BadResponse(
                "its echo lists no log-probs for the generated token after the prompt, so "
                "which distribution each position holds cannot be checked (use api: vllm or "
                "sglang)"
            )
        top = max(entries[n], key=lambda e: (e[0], -e[1]))[1]
        if top != echoed[n]:
            raise BadResponse(
                f"the greedy token {echoed[n]} is not the top of the log-probs listed with it "
                f"({top}): the server lists each position's distribution elsewhere than at the "
                "token drawn from it, which is not read (use api: vllm or sglang)"
            )

    def _read(self, choice: dict, p: Piece) -> tuple[list[int], list]:
        lps = choice.get("logprobs") if isinstance(choice, dict) else None
        if not isinstance(lps, dict) or not isinstance(lps.get("top_logprobs"), list):
            raise BadResponse("a choice without logprobs.top_logprobs", p.row, p.start)
        tokens, tops = lps.get("tokens"), lps["top_logprobs"]
        if not isinstance(tokens, list):
            raise BadResponse("a choice without logprobs.tokens", p.row, p.start)
        echoed = [self._id(t, (p.row, p.start)) for t in tokens]
        entries = []
        for top in tops:
            if top is None:
                entries.append(None)
                continue
            if not isinstance(top, dict):
                raise BadResponse("a top_logprobs entry that is not an object", p.row, p.start)
            entries.append([(v, self._id(t, (p.row, p.start))) for t, v in top.items()])
        return echoed, entries


class VLLM(_Json):
    """/v1/completions with vLLM's prompt_logprobs: k (entries keyed by id, the prompt
    token's own among them)."""

    _digits = True

    def _body(self, prompts: list) -> dict:
        return {"prompt": prompts, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": self.k}  # fmt: skip

    def _results(self, body, n: int) -> list:
        return _choices(body, n)

    def _read(self, choice: dict, p: Piece) -> tuple[list[int], list]:
        plp = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
        if not isinstance(plp, list):
            raise BadResponse("a choice without prompt_logprobs", p.row, p.start)
        echoed = choice.get("prompt_token_ids")
        entries = []
        for top in plp:
            if top is None:
                entries.append(None)
                continue
            if not isinstance(top, dict):
                raise BadResponse("a prompt_logprobs entry that is not an object", p.row, p.start)
            got = []
            for t, e in top.items():
                if not isinstance(e, dict):
                    raise BadResponse(f"entry {t!r} is not an object", p.row, p.start)
                rank, value = e.get("rank"), e.get("logprob")
                if rank is None and value is None:  # the prompt token's own, not known
                    continue
                if rank is None or rank <= self.k:  # the prompt token's own below k: out
                    got.append((value, self._id(t, (p.row, p.start))))
            entries.append(got)
        if not isinstance(echoed, list):  # each entry lists its prompt token: that is the echo
            echoed = [int(p.ids[0])] + [
                int(p.ids[j]) if e is not None and str(p.ids[j]) in plp[j] else -1
                for j, e in enumerate(entries) if j > 0
            ]  # fmt: skip
        return echoed, entries


class SGLang(_Json):
    """SGLang's /generate with return_logprob, logprob_start_len 0, top_logprobs_num: k."""

    path = "/generate"

    def _body(self, prompts: list) -> dict:
        return {"input_ids": prompts, "return_logprob": True, "logprob_start_len": 0,
                "top_logprobs_num": self.k,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}  # fmt: skip

    def _results(self, body, n: int) -> list:
        if not isinstance(body, list) or len(body) != n:
            raise BadResponse(f"the body is not a list of {n} results")
        return body

    def _read(self, result: dict, p: Piece) -> tuple[list[int], list]:
        meta = result.get("meta_info") if isinstance(result, dict) else None
        own = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        top = meta.get("input_top_logprobs") if isinstance(meta, dict) else None
        if not isinstance(own, list) or not isinstance(top, list):
            raise BadResponse("a result without meta_info.input_*_logprobs", p.row, p.start)
        try:
            echoed = [int(e[1]) for e in own]
            entries = [None if e is None else [(v[0], int(v[1])) for v in e] for e in top]
        except (TypeError, IndexError, ValueError):
            raise BadResponse("input logprobs that are not [logprob, id, text]", p.row,
                              p.start) from None  # fmt: skip
        return echoed, entries


class Distill:
    """`distill serve`'s binary top-k rows (`teacher.wire`), at the run's temperature."""

    path = "/v1/distill/topk"
    content_type = wire.CONTENT_TYPE

    def __init__(self, k: int, vocab: int, temperature: float):
        self.k, self.vocab, self.temperature = k, vocab, temperature

    def body(self, batch_rows) -> tuple[bytes, None]:
        tokens, _, segments, positions, _ = (np.asarray(a) for a in batch_rows)
        return wire.encode_request(tokens, segments, positions, self.k, self.temperature), None

    def answer(self, raw: bytes, _, batch_rows, k: int) -> Answer:
        sent, mask = np.asarray(batch_rows[0]), np.asarray(batch_rows[4])
        try:
            tokens, lp, ids, t = wire.decode_response(raw)
        except wire.WireError as e:
            raise BadResponse(f"not a top-k response: {e}") from None
        if lp.shape[:2] != sent.shape or lp.shape[2] < k:
            raise BadResponse(f"{lp.shape} log-probs for {sent.shape} rows and positions, k {k}")
        if not math.isclose(t, self.temperature, rel_tol=1e-6):
            raise BadResponse(f"log-probs at temperature {t}, not {self.temperature}")
        if (tokens != sent).any():
            r, at = (int(x[0]) for x in np.nonzero(tokens != sent))
            raise BadResponse(f"the server echoes token {tokens[r, at]} where the batch has "
                              f"{sent[r, at]}", r, at)  # fmt: skip
        out = Answer(lp[..., :k], ids[..., :k], mask > 0)
        _check_rows(out, self.vocab)
        return out


def _check_rows(answer: Answer, vocab: int) -> None:
    """The wire's answer at the rows' positions to learn: finite log-probs, ids in range."""
    m, lp, ids = answer.have, answer.logprobs, answer.ids
    bad = ~np.isfinite(lp).all(-1) | (lp > 1e-3).any(-1) | ((ids < 0) | (ids >= vocab)).any(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        bad |= np.exp(lp.astype(np.float64)).sum(-1) > 1.001
    if (m & bad).any():
        r, at = (int(x[0]) for x in np.nonzero(m & bad))
        raise BadResponse(
            "log-probs that are not finite or sum past 1, or ids outside the vocabulary", r, at
        )


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadResponse(f"the body is not JSON ({raw[:60]!r})") from None


def _choices(body, n: int) -> list:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        raise BadResponse(f"the body has no list of {n} choices")
    if all(isinstance(c, dict) and isinstance(c.get("index"), int) for c in choices):
        choices = sorted(choices, key=lambda c: c["index"])
    return choices


def _lead(echoed: list[int], sent: np.ndarray, bos: int | None, row: int, start: int) -> int:
    """How many sent ids the echo leaves out at the front: 0, or 1 for a leading BOS it does
    not list; its extra tokens after the prompt (the generated one) are ignored. A different
    id is a different tokenizer: an error at the first position that differs."""
    sent = [int(x) for x in sent]
    if len(echoed) < len(sent) - 1:
        raise BadResponse(f"the echo lists {len(echoed)} tokens of a {len(sent)}-token prompt",
                          row, start)  # fmt: skip
    lead = 1 if bos is not None and sent[:1] == [bos] and echoed[: len(sent) - 1] == sent[1:] else 0
    for j, want in enumerate(sent[lead:]):
        got = echoed[j] if j < len(echoed) else None
        if got != want:
            at = start + j + lead - 1 if j + lead else start
            raise BadResponse(
                f"the server's token {got} where the batch has {want} (prompt index {j + lead}): "
                "it tokenises differently from data.tokenizer",
                row,
                max(at, start),
            )
    return lead


def codec(api: str, k: int, vocab: int, model, bos_id, temperature: float, names=None):
    """The codec of `teacher.endpoint.api`."""
    if api == "distill":
        return Distill(k, vocab, temperature)
    return {"openai": OpenAI, "vllm": VLLM, "sglang": SGLang}[api](k, vocab, model, bos_id, names)
