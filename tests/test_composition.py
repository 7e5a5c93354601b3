"""Every pair of features `pipelines/composition.py` says composes runs (two steps at the
tests' tiny size), and every pair it says does not is refused by `distill validate` and
`distill run` alike, in one line holding the table's text, exit 2, before anything is
written; docs/reference/composition.md is the table the module generates. Most pairs'
runs are slow-marked (the default run keeps one of each kind of layout), ray's with the
ray tests."""

import copy

import pytest
import yaml

from pipelines import composition
from pipelines.commands.cli import main
from tests.conftest import read_train, tiny_config, write_config

# the pairs the default run trains (the rest: -m slow): placements, stages and experts,
# on-policy steps, the cache, chat data and a teacher behind a server
DEFAULT = {
    ("colocated", "cp"), ("auto", "ep"), ("pp", "on_policy"), ("ep", "moe_student"),
    ("chat", "grad_accum"), ("cache", "microbatch"), ("cross_tokenizer", "pretrained"),
    ("chat", "endpoint"),
}  # fmt: skip


@pytest.fixture(scope="module")
def files(tiny_run, corpus_dir, tmp_path_factory):
    """The files the features name: the tiny run's teacher, an MoE teacher bootstrapped
    here, a BPE tokenizer of the corpus, a pretrained Qwen3 student (320 ids: the BPE's or the
    bytes'), a ChatML template file for a tokenizer without one, and the tiny teacher
    served by `distill serve`."""
    from distill.data.bpe import train_bpe
    from distill.data.chat import BYTES_TEMPLATE

    tmp = tmp_path_factory.mktemp("composition")
    texts = [p.read_text() for p in sorted(corpus_dir.glob("*.txt"))]
    out = {"teacher": str(tiny_run.out / "teacher"), "moe_teacher": str(tmp / "moe_teacher")}
    out["bpe"] = str(train_bpe(texts, 300, tmp / "bpe" / "tokenizer.json"))
    (tmp / "chatml.jinja").write_text(BYTES_TEMPLATE)
    out["chatml"] = str(tmp / "chatml.jinja")
    tree = _base(corpus_dir, tmp / "moe_boot", out)
    tree["teacher"].update(pretrain_steps=2)
    args = composition.settings(["ep"], out)
    assert main(["run", write_config(tmp, tree), "--set", "train.steps=1", *_flags(args)]) == 0
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(str(tmp / "student"))
    out["student"] = str(tmp / "student")
    # the tiny run's teacher behind `distill serve`, on a real socket
    from distill.config.load import load_config
    from pipelines.serve.server import TeacherServer, load_service

    served = load_config(write_config(tmp, _base(corpus_dir, tmp / "served", out), "served.yaml"))
    server = TeacherServer(load_service(served, rows=4, wait_ms=5), port=0).start()
    out["endpoint"] = server.url
    yield out
    server.stop()


def _base(corpus_dir, out, files) -> dict:
    tree = tiny_config(str(corpus_dir), str(out))
    tree["teacher"].update(checkpoint=files["teacher"], pretrain_steps=0)
    tree["train"].update(steps=2, log_every=1, eval_every=2, checkpoint_every=2)
    tree["distill"] = {"alpha_gate": False}
    return tree


def _flags(settings) -> list[str]:
    return [arg for s in settings for arg in ("--set", s)]


def _pair_args(pair, files, tmp_path, online: bool = False) -> list[str]:
    """The pair's `--set` flags (`online`: the teacher online, as cache-teacher reads it)."""
    files = {**files, "cache": str(tmp_path / "cache")}
    args = composition.settings(pair, files)
    if {"chat", "cross_tokenizer"} <= set(pair):  # the BPE tokenizer has no template
        args.append(f"data.chat_template={files['chatml']}")
    return _flags(a for a in args if not (online and a == "teacher.source=cache"))


def test_the_table_is_current():
    assert composition.DOC.read_text() == composition.markdown(), (
        "docs/reference/composition.md is stale: python -m pipelines.composition"
    )


@pytest.mark.parametrize("pair", sorted(tuple(sorted(p)) for p in composition.REFUSED))
def test_refused_pairs_are_one_line_in_validate_and_run(pair, files, corpus_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("a user's file")
    path = write_config(tmp_path, _base(corpus_dir, out, files))
    _, want = composition.refusal(*pair)
    for command in ("validate", "run"):
        capsys.readouterr()
        assert main([command, path, *_pair_args(pair, files, tmp_path)]) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], (command, err)
    assert [p.name for p in out.iterdir()] == ["kept.txt"]


def _marks(pair):
    if "ray" in pair:
        return [pytest.mark.ray, pytest.mark.slow]
    return [] if pair in DEFAULT else [pytest.mark.slow]


RUNS = [p for p in composition.pairs() if composition.refusal(*p) is None]


@pytest.mark.parametrize("pair", [pytest.param(p, marks=_marks(p), id="+".join(p)) for p in RUNS])
def test_pairs_that_compose_run(pair, files, corpus_dir, tmp_path):
    tree = _base(corpus_dir, tmp_path / "out", files)
    args = _pair_args(pair, files, tmp_path)
    if "cache" in pair:  # the cache first, from the same teacher online
        online = copy.deepcopy(tree)
        online["run"]["output_dir"] = str(tmp_path / "online")
        write_config(tmp_path, online, "online.yaml")
        online_args = _pair_args(pair, files, tmp_path, online=True)
        assert main(["cache-teacher", str(tmp_path / "online.yaml"), *online_args]) == 0
    path = write_config(tmp_path, tree)
    assert main(["run", path, *args]) == 0
    assert [r["step"] for r in read_train(tmp_path / "out")] == [1, 2]
    resolved = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert resolved["train"]["steps"] == 2
