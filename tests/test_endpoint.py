"""`teacher.source: endpoint` against a real `distill serve` on a real socket: each API's
top-k equals the local teacher's, a run through it trains as the local teacher's does (a
server that goes away and comes back included), and malformed answers and bad config
fields stop with one line."""

import contextlib
import json
import logging
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jax
import numpy as np
import pytest

from distill.config.load import load_config
from distill.data.loader import load_corpus
from distill.errors import DistillError
from distill.mesh import role_mesh
from pipelines.commands import run
from pipelines.commands.cli import main
from pipelines.hooks import Every
from pipelines.serve.server import TeacherServer, load_service
from teacher.endpoint import EndpointTeacher
from teacher.online import OnlineTeacher
from tests.conftest import read_evals, train_by_step, write_config

APIS = ("openai", "vllm", "sglang", "distill")


def _tree(tiny_run, out, **endpoint) -> dict:
    """The session run's config with its teacher behind `endpoint` (alpha gate off)."""
    tree = json.loads(json.dumps(tiny_run.tree))
    tree["run"]["output_dir"] = str(out)
    tree["distill"] = {"alpha_gate": False}
    if endpoint:
        tree["teacher"].update(source="endpoint", endpoint=endpoint, pretrain_steps=0)
    return tree


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_run):
    """(the server, the session's config, its corpus, the local teacher at temperature T
    and at 1, the first train batch)."""
    tmp = tmp_path_factory.mktemp("endpoint")
    cfg = load_config(write_config(tmp, _tree(tiny_run, tmp / "out")))
    server = TeacherServer(load_service(cfg, rows=4, wait_ms=5), port=0).start()
    corpus = load_corpus(cfg.data, cfg.train.seq_len)
    mesh = role_mesh(cfg, "teacher")
    at_one = cfg.model_copy(deep=True)
    at_one.distill.temperature = 1.0
    local = {t: OnlineTeacher(c, mesh, corpus.tokenizer) for t, c in ((2.0, cfg), (1.0, at_one))}
    batch = jax.tree.map(np.asarray, next(corpus.train_iterator(4, 0)))
    yield server, cfg, corpus, local, batch
    server.stop()


def _endpoint_cfg(cfg, **endpoint):
    tree = cfg.model_dump(mode="json")
    tree["teacher"].update(source="endpoint", endpoint=endpoint, pretrain_steps=0)
    tree["distill"]["temperature"] = 1.0 if endpoint["api"] != "distill" else 2.0
    return type(cfg).model_validate(tree)


@pytest.mark.parametrize("api", APIS)
def test_each_api_gives_the_local_teachers_top_k(served, api):
    server, cfg, corpus, local, batch = served
    ecfg = _endpoint_cfg(cfg, url=server.url, api=api, rows_per_request=2)
    teacher = EndpointTeacher(ecfg, corpus.tokenizer, corpus.tokenizer.vocab_size)
    try:
        got = teacher.output(batch, 0).result()
    finally:
        teacher.close()
    want, _ = local[ecfg.distill.temperature].output(batch)
    m = batch.mask > 0
    assert got.logprobs.shape == want.logprobs.shape and got.ids.dtype == np.int32
    np.testing.assert_array_equal(got.ids[m], np.asarray(want.ids)[m])
    np.testing.assert_allclose(got.logprobs[m], np.asarray(want.logprobs)[m], atol=2e-5)


STEPS = {"steps": 6, "log_every": 1, "eval_every": 100, "checkpoint_every": 2}


@pytest.fixture(scope="module")
def local_out(tiny_run, tmp_path_factory):
    """The output of a 6-step run with the session's teacher loaded locally."""
    tmp = tmp_path_factory.mktemp("local")
    local = _tree(tiny_run, tmp / "out")
    local["train"].update(STEPS)
    assert main(["run", write_config(tmp, local)]) == 0
    return tmp / "out"


@pytest.fixture(scope="module")
def local_run(local_out):
    """Its training records by step."""
    return train_by_step(local_out)


@pytest.fixture(scope="module")
def local_evals(local_out):
    """Its evaluation records by step (0 and 6)."""
    return {r["step"]: r for r in read_evals(local_out)}


def test_a_run_through_distill_serve_trains_as_the_local_teacher_and_waits_out_an_outage(
    served, tiny_run, local_run, local_evals, tmp_path, caplog
):
    _, cfg, *_ = served
    own = TeacherServer(load_service(cfg, rows=4, wait_ms=5), port=0).start()
    state = {"server": own}

    def outage(step):  # the server goes away after step 1, and comes back 2 s later
        if step != 1:
            return
        state["server"].stop()

        def back():
            time.sleep(2)
            again = TeacherServer(load_service(cfg, rows=4, wait_ms=5), port=own.port)
            state["server"] = again.start()

        threading.Thread(target=back, daemon=True).start()

    ep = {"url": own.url, "api": "distill", "backoff_s": 0.5, "retries": 20}
    remote = _tree(tiny_run, tmp_path / "remote", **ep)
    remote["train"].update(STEPS)
    try:
        with caplog.at_level(logging.WARNING, logger="distill"):
            fault = Every(lambda _, step: outage(step), event="after_dispatch")
            run.run(load_config(write_config(tmp_path, remote, "remote.yaml")), extra=[fault])
    finally:
        state["server"].stop()
    assert any("the run waits" in r.getMessage() for r in caplog.records)
    got = train_by_step(tmp_path / "remote")
    # the evaluations: the student's own held-out figures, the local run's; no teacher's
    evals = {r["step"]: r for r in read_evals(tmp_path / "remote")}
    assert sorted(evals) == [0, 6] and "teacher_loss" not in evals[6] and "kl" not in evals[6]
    for step, want in local_evals.items():
        for key in ("student_loss", "student_bpb"):
            assert evals[step][key] == pytest.approx(want[key], abs=1e-5), (step, key)
    assert sorted(got) == sorted(local_run) == [1, 2, 3, 4, 5, 6]
    for step, want in local_run.items():
        assert got[step]["loss"] == pytest.approx(want["loss"], abs=1e-5), step
    assert got[6]["teacher_wait_s"] > 0  # the wait, in the records and the dashboard's status


def test_a_stop_while_the_server_is_away_checkpoints_and_a_resume_goes_on(
    served, tiny_run, local_run, tmp_path, caplog
):
    server, cfg, *_ = served
    own = TeacherServer(load_service(cfg, rows=4, wait_ms=5), port=0).start()

    def away_then_stop(loop, step):  # the server goes for good; the dashboard's stop 1 s later
        if step == 2:
            own.stop()
            threading.Timer(1.0, loop.store.request_stop).start()

    ep = {"url": own.url, "api": "distill", "backoff_s": 0.2, "retries": 50}
    tree = _tree(tiny_run, tmp_path / "out", **ep)
    tree["train"].update(STEPS)
    path = write_config(tmp_path, tree)
    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="distill"):
        summary = run.run(load_config(path), extra=[Every(away_then_stop, event="after_dispatch")])
    assert not summary["completed"] and time.perf_counter() - t0 < 60
    assert any("while waiting for the teacher's server" in r.getMessage() for r in caplog.records)
    saved = {int(p.name) for p in (tmp_path / "out" / "checkpoints").iterdir() if p.name.isdigit()}
    assert max(saved) == summary["steps"] < 6
    assert main(["run", path, "--set", f"teacher.endpoint.url={server.url}"]) == 0
    got = train_by_step(tmp_path / "out")
    assert {max(saved) + 1, 6} <= set(got)
    for step, record in got.items():
        assert record["loss"] == pytest.approx(local_run[step]["loss"], abs=1e-5), step


class _Flaky(BaseHTTPRequestHandler):
    """`distill serve`'s binary top-k behind a proxy that answers its first `good` requests
    and garbage after."""

    upstream, good, seen = "", 0, 0

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen += 1
        answer = b"garbage"
        if self.seen <= self.good:
            request = urllib.request.Request(self.upstream + self.path, body, dict(self.headers))
            answer = urllib.request.urlopen(request, timeout=60).read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def test_a_malformed_answer_mid_run_keeps_the_checkpoint_and_a_resume_goes_on(
    served, tiny_run, local_run, tmp_path, capsys
):
    server = served[0]
    _Flaky.upstream, _Flaky.good, _Flaky.seen = server.url, 4 * 4, 0  # 4 batches of 4 rows
    out = tmp_path / "out"
    with _http(_Flaky) as url:
        tree = _tree(tiny_run, out, url=url, api="distill", retries=0)
        tree["train"].update(STEPS)
        path = write_config(tmp_path, tree)
        assert main(["run", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "batch 4 row 0" in err[0] and "malformed" in err[0], err
    assert 2 in {int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()}
    assert max(train_by_step(out)) < 5  # never trained on batch 4
    assert main(["run", path, "--set", f"teacher.endpoint.url={server.url}"]) == 0
    got = train_by_step(out)  # the steps whose records the stopped run had not read yet: none
    assert {3, 4, 5, 6} <= set(got)
    for step, record in got.items():
        assert record["loss"] == pytest.approx(local_run[step]["loss"], abs=1e-5), step
    # the student is pinned to the served model's name, not to where it is served from
    capsys.readouterr()
    assert main(["validate", path, "--set", "teacher.endpoint.model=another"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "teacher.endpoint: " in err[0] and "distilled with" in err[0], err


class _Handler(BaseHTTPRequestHandler):
    def _reply(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Bad(_Handler):
    """Answers every POST with `answer`, but the client's first request (a prompt of two
    tokens, `EndpointTeacher._probe`) well: the greedy token listed with itself on top."""

    answer: bytes = b"{not json"

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        prompts = json.loads(body).get("prompt") if body.startswith(b"{") else None
        if isinstance(prompts, list) and len(prompts) == 1 and len(prompts[0]) == 2:
            a, b = prompts[0]
            top = [None, {f"token_id:{b}": -0.5}, {f"token_id:{b}": -0.5}]
            return self._reply(_openai_answer(None, [a, b, b], top))
        self._reply(self.answer)


def _forward(upstream: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        upstream + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


class _OneOff(_Handler):
    """llama-cpp-python's echo for a model without a BOS (0.3.16's source): each token
    listed with the distribution after it, the generated token left out."""

    upstream = ""

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = _forward(self.upstream, self.path, body)
        for choice in answer["choices"]:
            lps = choice["logprobs"]
            lps["top_logprobs"] = [None, *lps["top_logprobs"][2:]]
            lps["tokens"] = lps["tokens"][:-1]
        self._reply(json.dumps(answer).encode())


class _AddsBos(_Handler):
    """A server that puts a BOS before every prompt and does not list it: `distill serve`'s
    completions behind a proxy that adds the BOS and takes it out of the answer."""

    upstream, bos = "", 0

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body["prompt"] = [[self.bos, *p] for p in body["prompt"]]
        answer = _forward(self.upstream, self.path, body)
        for choice in answer["choices"]:
            lps = choice["logprobs"]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lps[key] = lps[key][1:]
            choice["prompt_token_ids"] = choice["prompt_token_ids"][1:]
        self._reply(json.dumps(answer).encode())


@contextlib.contextmanager
def _http(handler):
    """A real HTTP server on a free port with `handler`; its URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def bad_server():
    """A real HTTP server on a free port whose every POST gets `_Bad.answer`: its URL."""
    with _http(_Bad) as url:
        yield url


def test_a_server_one_position_off_is_refused_at_its_first_answer(served):
    server, cfg, corpus, *_ = served
    _OneOff.upstream = server.url
    with _http(_OneOff) as url:
        ecfg = _endpoint_cfg(cfg, url=url, api="openai")
        with pytest.raises(DistillError, match="the first request .* lists no log-probs for"):
            EndpointTeacher(ecfg, corpus.tokenizer, corpus.tokenizer.vocab_size)


def test_a_server_that_adds_a_bos_it_does_not_list(served):
    server, cfg, corpus, local, batch = served
    _AddsBos.upstream, _AddsBos.bos = server.url, corpus.tokenizer.bos_id
    with _http(_AddsBos) as url:
        ecfg = _endpoint_cfg(cfg, url=url, api="openai")
        teacher = EndpointTeacher(ecfg, corpus.tokenizer, corpus.tokenizer.vocab_size)
        tokens = batch.tokens.copy()
        tokens[:3, 0] = corpus.tokenizer.bos_id
        positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
        batch = batch._replace(tokens=tokens, segment_ids=np.ones_like(tokens), positions=positions)
        try:
            assert teacher._codec.adds_bos  # learnt from its first answer
            got = teacher.output(batch, 0).result()
        finally:
            teacher.close()
    want, _ = local[1.0].output(batch)
    # rows 0-2 are documents that start with their BOS; row 3's, continued from the row
    # before, this server scores after a BOS of its own: not the local teacher's
    m = batch.mask > 0
    m[3] = False
    np.testing.assert_array_equal(got.ids[m], np.asarray(want.ids)[m])
    np.testing.assert_allclose(got.logprobs[m], np.asarray(want.logprobs)[m], atol=2e-5)


def _openai_answer(batch, row_tokens, top):
    """An OpenAI completions body for the documents of `batch`'s row 0 (one prompt)."""
    tokens = [f"token_id:{t}" for t in row_tokens]
    return json.dumps({"choices": [{"index": 0, "logprobs": {"tokens": tokens,
                                    "top_logprobs": top}}]}).encode()  # fmt: skip


def test_malformed_answers_stop_with_one_line_naming_the_position(served, bad_server):
    _, cfg, corpus, _, batch = served
    ecfg = _endpoint_cfg(cfg, url=bad_server, api="openai", retries=0)
    one = jax.tree.map(lambda x: x[:1], batch._replace(segment_ids=np.ones_like(batch.segment_ids),
                                                     mask=np.ones_like(batch.mask)))  # fmt: skip
    prompt = [*one.tokens[0].tolist(), int(one.targets[0, -1])]
    good = [None] + [{f"token_id:{i}": -3 - 0.1 * i for i in range(8)}] * (len(prompt) - 1)
    nan = [*good[:5], {f"token_id:{i}": float("nan") for i in range(8)}, *good[6:]]
    out_of_range = [*good[:3], {f"token_id:{i + 9999}": -1.0 for i in range(8)}, *good[4:]]
    other_ids = [prompt[0], prompt[1] ^ 1, *prompt[2:]]
    cases = [
        (b"{not json", "not JSON"),
        (_openai_answer(one, prompt, good[:10]), "position 9: no log-probs"),
        (_openai_answer(one, prompt, nan), "position 4: log-prob nan"),
        (_openai_answer(one, prompt, out_of_range), "position 2: token id 9999 outside"),
        (_openai_answer(one, other_ids, good), "position 0: the server's token"),
        (_openai_answer(one, prompt, good[:4] + [{"token_id:1": -1.0}] + good[5:]),
         "position 3: 1 log-probs where 8"),
    ]  # fmt: skip
    tok = corpus.tokenizer
    text = [None] + [{tok.decode([100 + i]): -3 - 0.1 * i for i in range(8)}] * (len(prompt) - 1)
    teacher = EndpointTeacher(ecfg, tok, tok.vocab_size)
    try:
        _Bad.answer = _openai_answer(one, prompt, good)
        got = teacher.output(one, 7).result()  # the well-formed answer is read
        np.testing.assert_array_equal(got.ids[0], np.broadcast_to(np.arange(8), (32, 8)))
        # keyed by token text (a server without return_tokens_as_token_ids): read through
        # data.tokenizer where each text names one id
        answer = json.loads(_openai_answer(one, prompt, text))
        answer["choices"][0]["logprobs"]["tokens"] = [tok.decode([t]) for t in prompt]
        _Bad.answer = json.dumps(answer).encode()
        got = teacher.output(one, 7).result()
        np.testing.assert_array_equal(got.ids[0], np.broadcast_to(100 + np.arange(8), (32, 8)))
        for answer, words in cases:
            _Bad.answer = answer
            with pytest.raises(DistillError) as err:
                teacher.output(one, 7).result()
            line = str(err.value)
            assert "\n" not in line and "batch 7" in line and words in line, line
            assert "position" not in words or "batch 7 row 0 position" in line, line
    finally:
        teacher.close()


def test_a_run_given_garbage_stops_with_exit_2(tiny_run, tmp_path, bad_server, capsys):
    _Bad.answer = b"\x00garbage"
    tree = _tree(tiny_run, tmp_path / "out", url=bad_server, api="distill", retries=0)
    assert main(["run", write_config(tmp_path, tree)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "batch 0" in err[0] and "malformed" in err[0], err


def test_a_server_that_stays_away_stops_the_run_with_one_line(served):
    _, cfg, corpus, _, batch = served
    from distill.distributed import free_port

    url = f"http://127.0.0.1:{free_port()}"
    ecfg = _endpoint_cfg(cfg, url=url, api="distill", retries=2, backoff_s=0.05)
    teacher = EndpointTeacher(ecfg, corpus.tokenizer, corpus.tokenizer.vocab_size)
    try:
        with pytest.raises(DistillError, match="did not answer after 3 attempts"):
            teacher.output(batch, 0).result()
    finally:
        teacher.close()


@pytest.mark.parametrize(
    "sets, words",
    [
        (["teacher.source=endpoint"], "teacher.endpoint: required with teacher.source"),
        (["teacher.endpoint.url=ftp://x"], "teacher.endpoint.url: 'ftp://x': an http://"),
        (["teacher.endpoint.api=grpc"], "teacher.endpoint.api"),
        (["distill.temperature=2", "teacher.endpoint.api=vllm"], "distill.temperature: 2.0"),
        (["teacher.endpoint.top_k=4"], "teacher.endpoint.top_k: 4 is below teacher.top_k"),
        (["teacher.top_k=null"], "teacher.top_k: a served teacher"),
        (["distill.alpha_gate=true"], "distill.alpha_gate: not supported with teacher.source"),
        (["distill.on_policy.fraction=0.5"], "distill.on_policy.fraction: not supported"),
        (["pipeline.mode=ray"], "pipeline.mode: not supported with teacher.source: endpoint"),
        (["teacher.tokenizer=bytes_other"], "teacher.tokenizer"),
        (["teacher.endpoint.api_key_env=DISTILL_NO_SUCH_KEY"], "DISTILL_NO_SUCH_KEY is not set"),
        (["teacher.endpoint.ca_file=/nonexistent.pem"], "teacher.endpoint.ca_file: read only"),
        (["teacher.pretrain_steps=6"], "teacher.pretrain_steps: not supported with"),
        (["teacher.source=online"], "teacher.endpoint: read only with teacher.source: endpoint"),
    ],
)
def test_bad_endpoint_config_gives_one_line(tiny_run, tmp_path, capsys, sets, words):
    tree = _tree(tiny_run, tmp_path / "out", url="http://127.0.0.1:9", api="openai")
    tree["distill"]["temperature"] = 1.0
    if sets == ["teacher.source=endpoint"]:
        del tree["teacher"]["endpoint"]
    args = ["validate", write_config(tmp_path, tree)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_an_endpoint_config_validates_without_asking_the_server(tiny_run, tmp_path, capsys, caplog):
    """...and says which keys of a local teacher it leaves unread (the tiny config's
    mesh.teacher.tp, and a teacher.microbatch given here)."""
    tree = _tree(tiny_run, tmp_path / "out", url="http://127.0.0.1:9", api="distill")
    tree["teacher"]["microbatch"] = 2
    with caplog.at_level(logging.WARNING, logger="distill"):
        assert main(["validate", write_config(tmp_path, tree)]) == 0
    assert ": ok (" in capsys.readouterr().out
    (line,) = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert "teacher.microbatch, mesh.teacher.tp set but not read" in line, line


def test_eval_from_an_endpoint_is_refused(tiny_run, tmp_path, capsys):
    tree = _tree(tiny_run, tmp_path / "out", url="http://127.0.0.1:9", api="distill")
    assert main(["eval", write_config(tmp_path, tree)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "teacher.source: endpoint" in err[0], err


def test_a_cache_written_from_a_server_trains_as_the_local_teacher(
    served, tiny_run, local_run, tmp_path
):
    """`distill cache-teacher` of a config whose teacher is behind `distill serve`: the
    cache holds the server's top-k (its manifest names the server, its evaluation logits
    are skipped: a server gives none); a run from it (`teacher.source: cache`) gives the
    local teacher's run's losses step by step."""
    server, *_ = served
    tree = _tree(tiny_run, tmp_path / "out", url=server.url, api="distill")
    tree["train"].update(STEPS)
    tree["teacher"]["cache_dir"] = str(tmp_path / "cache")
    assert main(["cache-teacher", write_config(tmp_path, tree, "cache.yaml")]) == 0
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["teacher_hash"] == f"endpoint:{server.url} distill"
    assert manifest["steps_written"] == STEPS["steps"]
    assert (tmp_path / "cache" / "eval.arrayrecord.skipped").is_file()
    tree["teacher"].update(source="cache")
    del tree["teacher"]["endpoint"]
    assert main(["run", write_config(tmp_path, tree, "from-cache.yaml")]) == 0
    got = train_by_step(tmp_path / "out")
    assert sorted(got) == sorted(local_run)
    for step, want in local_run.items():
        assert got[step]["loss"] == pytest.approx(want["loss"], abs=1e-5), step


def test_a_teacher_behind_a_server_as_one_of_two_mixes_as_the_same_teacher(
    served, tiny_run, local_run, tmp_path
):
    """Several teachers (`teachers:`): the session's teacher loaded locally and the same
    teacher behind `distill serve`, mixed at equal weights: the mixture of one distribution
    with itself is that distribution, so every step's loss is the one-teacher local run's,
    and each teacher's divergence is the run's."""
    server, *_ = served
    tree = _tree(tiny_run, tmp_path / "two")
    tree["train"].update(STEPS)
    local = dict(tree.pop("teacher"), name="local")
    remote = dict(local, name="remote", source="endpoint", pretrain_steps=0)
    remote["endpoint"] = {"url": server.url, "api": "distill"}
    tree["teachers"] = [local, remote]
    assert main(["run", write_config(tmp_path, tree)]) == 0
    got = train_by_step(tmp_path / "two")
    assert sorted(got) == sorted(local_run)
    for step, want in local_run.items():
        assert got[step]["loss"] == pytest.approx(want["loss"], abs=1e-5), step
        each = got[step]["kd_loss_by_teacher"]
        assert each["local"] == pytest.approx(want["kd_loss"], abs=1e-5), step
        assert each["remote"] == pytest.approx(want["kd_loss"], abs=1e-5), step


SERVED = "pipelines/qwen3-8b-served.yaml"
STUDENTS = ("pipelines/qwen3-8b-to-1.7b-endpoint.yaml", "pipelines/qwen3-8b-to-0.6b-endpoint.yaml")
TINY_TEACHER = dict(
    vocab_size=260, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64
)  # fmt: skip


def test_the_shipped_served_teacher_answers_both_shipped_students(tmp_path):
    """The shipped example at the tests' size: `distill serve`'s config (a tiny Qwen3
    checkpoint saved by transformers in place of Qwen3-8B) behind a real socket, and both
    shipped students distilling from it in turn with api: distill (their own layouts
    shrunk to these devices), each run's every step trained."""
    import transformers

    teacher = tmp_path / "Qwen3-tiny"
    hf_cfg = transformers.Qwen3Config(
        vocab_size=260, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(hf_cfg).save_pretrained(str(teacher))
    served = load_config(SERVED, [
        f"teacher.checkpoint={teacher}", "data.tokenizer=bytes", "mesh.teacher.tp=2",
        "teacher.dtype=float32", "train.seq_len=64", "train.batch_size=4",
    ])  # fmt: skip
    server = TeacherServer(load_service(served, wait_ms=5), port=0).start()
    try:
        for i, path in enumerate(STUDENTS):
            sets = [
                f"teacher.endpoint.url={server.url}", "teacher.endpoint.api=distill",
                *(f"teacher.model.{k}={v}" for k, v in TINY_TEACHER.items()),
                "student.model.d_model=16", "student.model.n_layers=1",
                "student.model.n_heads=2", "student.model.n_kv_heads=1", "student.model.d_ff=32",
                "mesh.student.fsdp=2", "train.steps=2", "train.batch_size=4",
                "train.seq_len=64", "train.grad_accum=1", "train.eval_every=2",
                "train.checkpoint_every=2", "train.log_every=1", "data.max_bytes=200000",
                f"run.output_dir={tmp_path / f'student{i}'}", "server.port=0",
            ]  # fmt: skip
            args = [x for s in sets for x in ("--set", s)]
            assert main(["run", path, *args]) == 0, path
            assert sorted(train_by_step(tmp_path / f"student{i}")) == [1, 2]
    finally:
        server.stop()
