"""The teacher behind a server (`teacher.source: endpoint`): its top-k for each batch,
asked over HTTP in the form the online teacher gives it (`distill.types.TeacherOutput`).

`EndpointTeacher.output(batch, index)` sends the batch's rows at once (`rows_per_request`
rows a request, at most `concurrency` requests in flight over every batch) and returns a
`Pending`, whose `result()` waits for all of them: values and ids [B, S, k] at distill's
positions, host arrays, the tail implied as the online teacher's is. A transient failure
(connection refused or reset, a timeout, HTTP 408, 429, 5xx) is retried with doubling waits,
the run waiting meanwhile, each wait logged; a batch is only ever handed on whole. A
malformed answer (`teacher.endpoint_apis`) or a refused request stops the run with one
`DistillError` line naming the batch, its row and the position. The APIs' formats and
position conventions are in `teacher.endpoint_apis`.
"""

from __future__ import annotations

import http.client
import logging
import ssl
import threading
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from distill.config import Config
from distill.config.endpoint import EndpointConfig
from distill.data.tokenizers import Tokenizer
from distill.errors import DistillError
from distill.types import Batch, TeacherOutput
from teacher.endpoint_apis import Answer, BadResponse, codec
from teacher.endpoint_llamacpp import LlamaCpp

log = logging.getLogger("distill")

_TRANSIENT = {408, 429}


class _Transient(Exception):
    """A failure worth retrying."""


class _Http:
    """POSTs to one server, a keep-alive connection per thread."""

    def __init__(self, ep: EndpointConfig):
        u = urllib.parse.urlsplit(ep.url)
        self.url, self._base = ep.url, u.path.rstrip("/")
        self._https, self._host, self._port = u.scheme == "https", u.hostname, u.port
        self._timeout = ep.timeout_s
        self._ctx = None
        if self._https:
            self._ctx = ssl.create_default_context(cafile=ep.ca_file)
            if not ep.tls_verify:
                self._ctx.check_hostname = False
                self._ctx.verify_mode = ssl.CERT_NONE
        self._headers = {"Accept": "*/*"}
        if (key := ep.api_key()) is not None:
            self._headers["Authorization"] = f"Bearer {key}"
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._https:
                conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout, context=self._ctx
                )
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            self._local.conn = conn
        return conn

    def post(self, path: str, body: bytes, content_type: str) -> bytes:
        """One attempt: the body of a 200 answer. Raises `_Transient`, or DistillError for
        an answer that no retry changes (a 4xx)."""
        conn = self._conn()
        headers = {**self._headers, "Content-Type": content_type}
        try:
            conn.request("POST", self._base + path, body, headers)
            resp = conn.getresponse()
            data = resp.read()
        except ssl.SSLCertVerificationError as e:
            self._drop()
            raise DistillError(
                f"teacher.endpoint.url: {self.url}: its certificate does not verify ({e.reason}); "
                "set teacher.endpoint.ca_file, or tls_verify: false"
            ) from None
        except (OSError, http.client.HTTPException) as e:
            self._drop()
            raise _Transient(f"{type(e).__name__}: {e}") from None
        if resp.status in _TRANSIENT or resp.status >= 500:
            self._drop()
            raise _Transient(f"HTTP {resp.status}")
        if resp.status != 200:
            hint = " (check teacher.endpoint.api_key_env)" if resp.status in (401, 403) else ""
            text = data[:300].decode("utf-8", "replace").replace("\n", " ")
            raise DistillError(
                f"teacher.endpoint: {self.url}{path} refused the request with HTTP "
                f"{resp.status}{hint}: {text}"
            )
        return data

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None


class Pending:
    """A batch's requests in flight; `result()` is its `TeacherOutput` once all are in."""

    def __init__(self, batch_index: int, parts: list[tuple[slice, Future]], shape, k: int):
        self.index, self._parts, self._shape, self._k = batch_index, parts, shape, k
        self._out: TeacherOutput | None = None

    def placeholder(self) -> TeacherOutput:
        """k equal log-probs at every position: what the loss never reads."""
        rows, length = self._shape
        lp = np.full((rows, length, self._k), -np.log(self._k), np.float32)
        ids = np.broadcast_to(np.arange(self._k, dtype=np.int32), lp.shape).copy()
        return TeacherOutput(lp, ids)

    def result(self, interrupted=None) -> TeacherOutput | None:
        """The output, waiting for every request; None, with the requests left running,
        as soon as `interrupted()` is true (checked twice a second while waiting)."""
        if self._out is None:
            for _, future in self._parts:
                while interrupted is not None:
                    try:
                        future.result(timeout=0.5)
                        break
                    except FutureTimeout:
                        if interrupted():
                            return None
            out = self.placeholder()
            for rows_of, future in self._parts:
                answer = future.result()
                have = answer.have
                out.logprobs[rows_of][have] = answer.logprobs[have]
                out.ids[rows_of][have] = answer.ids[have]
            self._out = out
        return self._out

    def cancel(self) -> None:
        for _, future in self._parts:
            future.cancel()


class EndpointTeacher:
    """The teacher of `teacher.endpoint`: `output(batch, index)` -> `Pending`. Positions
    the loss does not read (padding, a document's last token) hold a placeholder of k
    equal log-probs; every position it reads is the server's."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer, vocab: int):
        ep = cfg.teacher.endpoint
        self.ep, self.k = ep, cfg.teacher.top_k
        self._http = _Http(ep)
        ask = ep.top_k or self.k
        names = _names(tokenizer, vocab) if ep.api == "openai" else None
        bos = getattr(tokenizer, "bos_id", None)
        if ep.api == "llamacpp":
            self._codec = LlamaCpp(ask, vocab, ep.model, tokenizer)
        else:
            self._codec = codec(ep.api, ask, vocab, ep.model, bos, cfg.distill.temperature, names)
        self._pool = ThreadPoolExecutor(ep.concurrency, thread_name_prefix="teacher-endpoint")
        self.waited_s = 0.0  # the run's time in retry waits (the longest of parallel ones)
        self._waits: dict[int, float] = {}  # each request thread's own waits
        self._closed = threading.Event()  # wakes the retry waits: no thread outlives the run
        self._probe()

    def _probe(self) -> None:
        """The JSON APIs: one small request first, to learn how the server lists a prompt
        (`teacher.endpoint_apis._Json.probe`); it waits for a server not up yet."""
        probe = getattr(self._codec, "probe", None)
        if probe is None:
            return
        try:
            probe(self._post_to if isinstance(self._codec, LlamaCpp) else self._post)
        except BadResponse as e:
            raise DistillError(
                f"teacher.endpoint: {self.ep.url}{self._codec.path}: the first request (how "
                f"the server lists positions): {e}"
            ) from None
        if self._codec.adds_bos:
            log.warning(
                "teacher endpoint %s puts a BOS before every prompt: a document that starts "
                "with one is sent without it; a row's first document, continued from the row "
                "before, is scored after a BOS the local teacher would not see",
                self.ep.url,
            )

    def output(self, batch: Batch, index: int) -> Pending:
        """Send batch `index`'s rows (host arrays [B, S]); not waited for."""
        fields = [np.asarray(a) for a in batch[:5]]
        rows, n = fields[0].shape[0], self.ep.rows_per_request
        parts = []
        for lo in range(0, rows, n):
            part = slice(lo, min(lo + n, rows))
            parts.append((part, self._pool.submit(self._ask, [f[part] for f in fields], index, lo)))
        return Pending(index, parts, fields[0].shape, self.k)

    def _ask(self, rows: list[np.ndarray], index: int, first_row: int):
        try:
            if isinstance(self._codec, LlamaCpp):  # a request per document, its own paths
                return _keep(self._codec.ask(rows, self._post_to), self.k)
            body, ctx = self._codec.body(rows)
            if not body:  # no position to learn in these rows
                shape = rows[0].shape
                zeros = np.zeros((*shape, self.k), np.float32)
                return Answer(zeros, zeros.astype(np.int32), np.zeros(shape, bool))
            return self._codec.answer(self._post(body), ctx, rows, self.k)
        except BadResponse as e:
            n = len(rows[0])
            where = f"batch {index}"
            if e.row is not None or n == 1:
                where += f" row {first_row + (e.row or 0)}"
            else:  # the whole body: every row of the request
                where += f" rows {first_row}-{first_row + n - 1}"
            if e.position is not None:
                where += f" position {e.position}"
            raise DistillError(
                f"teacher.endpoint: {self.ep.url}{self._codec.path}: a malformed answer for "
                f"{where}: {e}"
            ) from None

    def _post_to(self, path: str, body: bytes) -> bytes:
        return self._post(body, path)

    def _post(self, body: bytes, path: str | None = None) -> bytes:
        ep, path = self.ep, path or self._codec.path
        wait, waited = ep.backoff_s, 0.0
        for attempt in range(ep.retries + 1):
            try:
                return self._http.post(path, body, self._codec.content_type)
            except _Transient as e:
                if attempt == ep.retries:
                    raise DistillError(
                        f"teacher.endpoint.url: {ep.url}{path} did not answer after "
                        f"{attempt + 1} attempts over {waited:.0f} s ({e}); the run stops, its "
                        "newest checkpoint kept"
                    ) from None
                log.warning(
                    "teacher endpoint %s: %s; the run waits %.1f s, then retries (%d of %d; "
                    "%.0f s waited so far)", ep.url, e, wait, attempt + 1, ep.retries, waited,
                )  # fmt: skip
                if self._closed.wait(wait):
                    raise DistillError("teacher.endpoint: the run stopped meanwhile") from None
                waited += wait
                me = threading.get_ident()  # requests wait side by side: count the longest
                self._waits[me] = self._waits.get(me, 0.0) + wait
                self.waited_s = max(self.waited_s, self._waits[me])
                wait = min(wait * 2, ep.max_backoff_s)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _keep(answer: Answer, k: int) -> Answer:
    """The `k` largest of an answer asked with teacher.endpoint.top_k >= k (sorted)."""
    return answer._replace(logprobs=answer.logprobs[..., :k], ids=answer.ids[..., :k])


def _names(tokenizer: Tokenizer, vocab: int):
    """A lazy table of token text -> id for servers that key their entries by text (an
    OpenAI server without return_tokens_as_token_ids); texts several ids share are left out
    (such a key is refused)."""
    table: dict[str, int] | None = None

    def get() -> dict[str, int]:
        nonlocal table
        if table is None:
            seen: dict[str, int] = {}
            for i in range(min(vocab, tokenizer.vocab_size)):
                text = tokenizer.decode([i])
                seen[text] = -1 if text in seen else i
            table = {t: i for t, i in seen.items() if i >= 0}
        return table

    return get
