"""`distill serve` on a real socket: each API's answers against the local teacher's top-k."""

import json
import threading

import httpx
import jax
import numpy as np
import pytest

from distill.config.load import load_config
from distill.data.loader import load_corpus
from distill.mesh import role_mesh
from pipelines.serve.server import TeacherServer, load_service
from teacher import wire
from teacher.online import OnlineTeacher
from tests.conftest import write_config


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_run):
    """(the server, the config, the local teacher at distill.temperature and at 1, the first
    train batch): the session run's bootstrapped teacher served on a free port, 4 rows a
    forward."""
    tmp = tmp_path_factory.mktemp("serve")
    tree = json.loads(json.dumps(tiny_run.tree))
    tree["run"]["output_dir"] = str(tmp / "out")
    cfg = load_config(write_config(tmp, tree))
    server = TeacherServer(load_service(cfg, rows=4, wait_ms=20), port=0).start()
    corpus = load_corpus(cfg.data, cfg.train.seq_len)
    mesh = role_mesh(cfg, "teacher")
    local = OnlineTeacher(cfg, mesh, corpus.tokenizer)
    at_one = cfg.model_copy(deep=True)
    at_one.distill.temperature = 1.0
    local_one = OnlineTeacher(at_one, mesh, corpus.tokenizer)
    batch = jax.tree.map(np.asarray, next(corpus.train_iterator(4, 0)))
    yield server, cfg, (local, local_one), batch
    server.stop()


def _local(local, batch):
    out, _ = local.output(batch)
    return np.asarray(out.logprobs), np.asarray(out.ids)


def _one_doc(batch, n: int):
    """A batch of the first `n` tokens of row 0 as one document from position 0."""
    tokens = batch.tokens[:1, :n]
    rows = np.zeros((4, n), np.int32)
    rows[0] = tokens
    segs = np.zeros((4, n), np.int32)
    segs[0] = 1
    pos = np.tile(np.arange(n, dtype=np.int32), (4, 1))
    return batch._replace(tokens=rows, targets=rows, segment_ids=segs, positions=pos,
                          mask=segs.astype(np.float32))  # fmt: skip


def test_binary_topk_equals_the_local_teacher(served):
    server, cfg, (local, _), batch = served
    t = cfg.distill.temperature
    assert t != 1.0  # the run's own temperature, not the JSON APIs'
    body = wire.encode_request(batch.tokens, batch.segment_ids, batch.positions, 8, t)
    r = httpx.post(f"{server.url}/v1/distill/topk", content=body, timeout=60)
    assert r.status_code == 200, r.text
    tokens, lp, ids, got_t = wire.decode_response(r.content)
    assert got_t == t
    want_lp, want_ids = _local(local, batch)
    np.testing.assert_array_equal(tokens, batch.tokens)
    m = batch.mask > 0
    np.testing.assert_array_equal(ids[m], want_ids[m])
    np.testing.assert_allclose(lp[m], want_lp[m], atol=1e-5)


def test_completions_and_sglang_shift_by_one(served):
    server, _, (_, local), batch = served
    n = 20
    prompt = batch.tokens[0, :n].tolist()
    want_lp, want_ids = _local(local, _one_doc(batch, n))
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 5,
            "prompt_logprobs": 5, "return_tokens_as_token_ids": True}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lps = choice["logprobs"]
    assert lps["tokens"] == [f"token_id:{t}" for t in prompt]
    assert lps["top_logprobs"][0] is None and lps["token_logprobs"][0] is None
    for i in range(1, n):  # entry i: the distribution token i came from = distill's i - 1
        top = lps["top_logprobs"][i]
        assert [int(t.split(":")[1]) for t in top] == want_ids[0, i - 1, :5].tolist()
        np.testing.assert_allclose(list(top.values()), want_lp[0, i - 1, :5], atol=1e-5)
        entry = choice["prompt_logprobs"][i]
        assert str(prompt[i]) in entry  # the prompt token's own log-prob, in top-k or not
        if prompt[i] in want_ids[0, i - 1]:
            j = want_ids[0, i - 1].tolist().index(prompt[i])
            assert lps["token_logprobs"][i] == pytest.approx(want_lp[0, i - 1, j], abs=1e-5)
    assert choice["prompt_logprobs"][0] is None
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}  # fmt: skip
    meta = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["meta_info"]
    assert meta["input_top_logprobs"][0] is None
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt
    for i in range(1, n):
        assert [t for _, t, _ in meta["input_top_logprobs"][i]] == want_ids[0, i - 1, :3].tolist()


def test_concurrent_clients_are_batched_and_each_answered(served):
    server, cfg, (local, _), batch = served
    t = cfg.distill.temperature
    before = httpx.get(f"{server.url}/status").json()
    want_lp, want_ids = _local(local, batch)
    got, errors = {}, []

    def client(c: int):
        try:
            for j in range(3):
                r = c % 4
                body = wire.encode_request(
                    batch.tokens[r : r + 1], batch.segment_ids[r : r + 1],
                    batch.positions[r : r + 1], 8, t,
                )  # fmt: skip
                resp = httpx.post(f"{server.url}/v1/distill/topk", content=body, timeout=60)
                got[c, j] = (r, wire.decode_response(resp.content))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(got) == 12
    for r, (_, lp, ids, _) in got.values():
        m = batch.mask[r] > 0
        np.testing.assert_array_equal(ids[0][m], want_ids[r][m])
        np.testing.assert_allclose(lp[0][m], want_lp[r][m], atol=1e-5)
    after = httpx.get(f"{server.url}/status").json()
    assert after["requests"] - before["requests"] == 12
    assert after["rows"] - before["rows"] == 12
    assert after["batches"] - before["batches"] < 12  # some forwards took several requests
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'distill_serve_requests_total{api="distill"}' in metrics
    assert "distill_serve_batch_rows_bucket" in metrics


def test_bad_requests_get_a_400_and_the_server_goes_on(served):
    server, *_ = served
    url = server.url
    cases = [
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 5}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 999], "max_tokens": 0}, "token ids"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0, "logprobs": 9}, "logprobs"),
        ("/v1/completions", {"prompt": [], "max_tokens": 0}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2], "model": "other", "max_tokens": 0}, "model"),
    ]
    for path, body, word in cases:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and word in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(url + "/v1/distill/topk", content=b"DTK1\x01\x00")
    assert r.status_code == 400 and "header" in r.text
    r = httpx.post(
        url + "/v1/distill/topk", content=wire.encode_request([[1, 2]], [[1, 1]], [[0, 1]], 8)[:-4]
    )
    assert r.status_code == 400 and "bytes" in r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": "the teacher", "max_tokens": 1,
                                                  "logprobs": 2})  # fmt: skip
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 1
