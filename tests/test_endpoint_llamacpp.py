"""`teacher.endpoint.api: llamacpp` against a real llama-cpp-python server: a tiny Llama
written here as a transformers checkpoint (the local teacher) and as a GGUF (the server's,
`tests/llamacpp_files.py`), `python -m llama_cpp.server` on a loopback socket. The codec's
top-k equals the local teacher's at every position the loss reads, documents with and
without a BOS (the server's two conventions) among them, and a run through the server gives
the local run's losses.

Slow (a server process per module; llama.cpp scores a position in about 1 ms here) and
skipped where llama-cpp-python is not installed: it builds llama.cpp from source
(docs/guides/teacher-endpoint.md says how).
"""

import importlib.util
import random

import jax
import numpy as np
import pytest

from distill.config.load import load_config
from distill.data.loader import load_corpus
from distill.mesh import role_mesh
from pipelines.commands.cli import main
from teacher.endpoint import EndpointTeacher
from teacher.endpoint_apis import pieces
from teacher.online import OnlineTeacher
from tests.conftest import WORDS, tiny_config, train_by_step, write_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None,
        reason="needs llama-cpp-python[server] and gguf (pip wheel llama-cpp-python: "
        "docs/guides/teacher-endpoint.md)",
    ),
]

TOP_K = 8


def _tree(corpus_dir, out, hf_dir, **endpoint) -> dict:
    tree = tiny_config(str(corpus_dir), str(out))
    tree["teacher"] = {"checkpoint": str(hf_dir), "pretrain_steps": 0, "top_k": TOP_K}
    tree["mesh"] = {"teacher": {"tp": 1}, "student": {"dp": 2}}
    tree["distill"] = {"alpha_gate": False, "temperature": 1.0}
    tree["train"].update(seq_len=48, steps=4, log_every=1, eval_every=100, checkpoint_every=100)
    if endpoint:
        tree["teacher"].update(source="endpoint", endpoint=endpoint)
    return tree


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """Short documents (a sentence each), so a row holds several, each with its BOS."""
    root = tmp_path_factory.mktemp("sentences")
    rng = random.Random(0)
    for i in range(48):
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choices(WORDS, k=rng.randint(2, 6))))
    return root


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(the server's URL, a directory of the module's, the transformers checkpoint's)."""
    from tests.llamacpp_files import llama_server, write_gguf, write_llama

    tmp = tmp_path_factory.mktemp("llamacpp")
    hf = write_llama(tmp / "hf")
    gguf = write_gguf(hf, tmp / "tiny.gguf")
    with llama_server(gguf, tmp / "server.log") as url:
        yield url, tmp, hf


def test_llamacpp_gives_the_local_teachers_top_k(llama, corpus_dir):
    url, tmp, hf = llama
    cfg = load_config(write_config(tmp, _tree(corpus_dir, tmp / "out", hf)))
    cfg.resolve_dtypes("cpu")
    corpus = load_corpus(cfg.data, cfg.train.seq_len)
    ecfg = load_config(
        write_config(tmp, _tree(corpus_dir, tmp / "out", hf, url=url, api="llamacpp"), "e.yaml")
    )
    teacher = EndpointTeacher(ecfg, corpus.tokenizer, corpus.tokenizer.vocab_size)
    local = OnlineTeacher(cfg, role_mesh(cfg, "teacher"), corpus.tokenizer)
    batches, bos = corpus.train_iterator(4, 0), corpus.tokenizer.bos_id
    try:
        for index in range(2):
            batch = jax.tree.map(np.asarray, next(batches))
            got = teacher.output(batch, index).result()
            want, _ = local.output(batch)
            m = batch.mask > 0
            # documents starting with the BOS (listed from their second token) and rows'
            # first documents continued from the row before (listed from their first)
            starts = {int(p.ids[0] == bos) for p in pieces(*batch[:3], batch.mask)}
            assert starts == {0, 1}
            np.testing.assert_array_equal(got.ids[m], np.asarray(want.ids)[m])
            np.testing.assert_allclose(got.logprobs[m], np.asarray(want.logprobs)[m], atol=2e-5)
    finally:
        teacher.close()


def test_a_run_through_llamacpp_gives_the_local_runs_losses(llama, corpus_dir, tmp_path):
    url, _, hf = llama
    local = _tree(corpus_dir, tmp_path / "local", hf)
    assert main(["run", write_config(tmp_path, local, "local.yaml")]) == 0
    served = _tree(corpus_dir, tmp_path / "served", hf, url=url, api="llamacpp", concurrency=2)
    assert main(["run", write_config(tmp_path, served, "served.yaml")]) == 0
    want, got = train_by_step(tmp_path / "local"), train_by_step(tmp_path / "served")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step, record in want.items():
        assert got[step]["loss"] == pytest.approx(record["loss"], abs=1e-5), step


def test_a_llamacpp_server_that_adds_a_bos_is_refused_in_one_line(llama, corpus_dir, capsys):
    from tests.llamacpp_files import llama_server

    _, tmp, hf = llama
    flags = ("--kv_overrides", "tokenizer.ggml.add_bos_token=bool:true")
    with llama_server(tmp / "tiny.gguf", tmp / "bos.log", 512, *flags) as url:
        tree = _tree(corpus_dir, tmp / "bos", hf, url=url, api="llamacpp")
        assert main(["run", write_config(tmp, tree, "bos.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "puts its own BOS" in err[0], err
    assert "--kv_overrides tokenizer.ggml.add_bos_token=bool:false" in err[0]
