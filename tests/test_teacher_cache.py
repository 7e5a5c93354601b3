"""Offline distillation: cache-teacher, then train from the cache through the same step."""

import json
from pathlib import Path

import pytest

from pipelines.commands.cli import main
from tests.conftest import read_evals as _evals
from tests.conftest import read_train as _train
from tests.conftest import write_config as _write


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def online(tmp_path_factory, tiny_run):
    """(a directory of this module's own, the online run's config): the online run, which
    bootstrapped the teacher the caches are written from, is the session's `tiny_run`."""
    return tmp_path_factory.mktemp("cache"), tiny_run.tree


def _cache_cfg(online, name: str, **teacher) -> dict:
    """The online run's config writing to <tmp>/<name>, logging every step, with the online
    run's teacher (not bootstrapped again) and a teacher cache under it."""
    tmp, cfg = online
    cfg = json.loads(json.dumps(cfg))
    cfg["run"]["output_dir"] = str(tmp / name)
    cfg["train"]["log_every"] = 1
    cfg["teacher"].update(pretrain_steps=0, cache_dir=str(tmp / name / "cache"), **teacher)
    return cfg


def test_cache_then_train_matches_online(online, capsys):
    tmp, online_cfg = online
    cfg = _cache_cfg(online, "offline")
    path = _write(tmp, cfg, "offline.yaml")
    capsys.readouterr()
    assert main(["cache-teacher", path, "--batches-per-shard", "4"]) == 0
    info = _last_json(capsys)
    assert info["steps_written"] == 6 and info["shards"] == 2
    assert info["dense_float32_bytes_per_token"] == 260 * 4
    assert 0 < info["bytes_per_token"] < 260 * 4
    manifest = json.loads((tmp / "offline" / "cache" / "manifest.json").read_text())
    assert manifest["top_k"] == 8 and manifest["teacher_hash"].startswith("sha256:")

    cfg["teacher"]["source"] = "cache"
    cfg["teacher"]["checkpoint"] = str(tmp / "absent")  # no teacher is needed from here on
    cfg["teacher"]["pretrain_steps"] = 1  # (only so preflight accepts the absent checkpoint)
    assert main(["run", _write(tmp, cfg, "offline.yaml")]) == 0
    out, ref = tmp / "offline", Path(online_cfg["run"]["output_dir"])
    assert not (tmp / "absent").exists()
    got, want = _train(out), _train(ref)
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [r["step"] for r in want] == [2, 4, 6]  # the online run logs every 2 steps
    got = [r for r in got if r["step"] % 2 == 0]
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "kd_loss", "ce_loss", "lr", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key)
        assert a["bytes_per_token"] == b["bytes_per_token"]
    for a, b in zip(_evals(out), _evals(ref), strict=True):
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-5)
        assert a["teacher_loss"] == pytest.approx(b["teacher_loss"], rel=1e-5)
    assert json.loads((out / "summary.json").read_text())["completed"]

    from distill.config.load import config_from_dict
    from pipelines.offline import teacher_cache
    from pipelines.sources import CacheSource

    # a cache written before evaluation spread its rows over the split: its eval logits
    # are of other rows, so they are not used (training from its shards still is)
    root = tmp / "offline" / "cache"
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["eval_rows"] == "spread"
    assert teacher_cache.eval_logits(config_from_dict(cfg)) is not None
    old = {k: v for k, v in manifest.items() if k != "eval_rows"}
    (root / "manifest.json").write_text(json.dumps(old))
    assert teacher_cache.eval_logits(config_from_dict(cfg)) is None
    (root / "manifest.json").write_text(json.dumps(manifest))

    # the alpha gate closed: the cached batches come without their outputs (the
    # cross-entropy step), reopened with them
    source = CacheSource(config_from_dict(cfg))
    source.start(None)
    source.submit()
    assert source.gate(False) is False  # no on-policy steps
    head = source.peek()
    assert head.teacher_out is None and head.batch.tokens.shape == (4, 32)
    source.gate(True)
    assert source.peek().teacher_out.logprobs.shape == (4, 32, 8)
    assert source.pop().teacher_out is not None


def test_colocated_cache_then_train_matches_online(online):
    """`cache-teacher` and the cached run with both meshes on the same devices
    (`mesh.placement: colocated`): the online split run's losses."""
    tmp, online_cfg = online
    cfg = _cache_cfg(online, "colocated")
    cfg["mesh"]["placement"] = "colocated"
    path = _write(tmp, cfg, "colocated.yaml")
    assert main(["cache-teacher", path]) == 0
    cfg["teacher"]["source"] = "cache"
    assert main(["run", _write(tmp, cfg, "colocated.yaml")]) == 0
    got = {r["step"]: r for r in _train(tmp / "colocated")}
    for b in _train(Path(online_cfg["run"]["output_dir"])):
        assert got[b["step"]]["loss"] == pytest.approx(b["loss"], rel=1e-5), b["step"]


def test_cache_mode_resumes_from_a_checkpoint(online, tmp_path):
    """The cache iterator's state is checkpointed: a rerun after dropping step 6 repeats it."""
    import shutil

    tmp, _ = online
    cfg = _cache_cfg(online, "resume")
    assert main(["cache-teacher", _write(tmp_path, cfg)]) == 0
    cfg["teacher"]["source"] = "cache"
    path = _write(tmp_path, cfg)
    assert main(["run", path]) == 0
    out = tmp / "resume"
    first = {r["step"]: r for r in _train(out)}
    shutil.rmtree(out / "checkpoints" / "6")
    assert main(["run", path]) == 0
    again = _train(out)[len(first) :]
    assert [r["step"] for r in again] == [4, 5, 6]
    for r in again:
        assert r["loss"] == pytest.approx(first[r["step"]]["loss"], rel=1e-5)


def test_cache_teacher_resumes_after_the_last_complete_shard(online, capsys):
    tmp, _ = online
    cfg = _cache_cfg(online, "partial", top_k=4)
    cfg["train"]["steps"] = 4
    path = _write(tmp, cfg, "partial.yaml")
    assert main(["cache-teacher", path, "--batches-per-shard", "2"]) == 0
    first = _last_json(capsys)
    assert (first["steps_written"], first["written_now"], first["shards"]) == (4, 4, 2)
    cache = tmp / "partial" / "cache"
    shard0 = (cache / "train-00000.arrayrecord").read_bytes()
    # an interrupted writer leaves a temporary shard behind: it is discarded
    (cache / "train-00002.arrayrecord.tmp").write_bytes(b"partial")
    cfg["train"]["steps"] = 7
    path = _write(tmp, cfg, "partial.yaml")
    assert main(["cache-teacher", path, "--batches-per-shard", "2"]) == 0
    second = _last_json(capsys)
    assert (second["steps_written"], second["written_now"], second["shards"]) == (7, 3, 4)
    assert not list(cache.glob("*.tmp"))
    assert (cache / "train-00000.arrayrecord").read_bytes() == shard0
    assert main(["cache-teacher", path, "--batches-per-shard", "2"]) == 0
    assert _last_json(capsys)["written_now"] == 0
    # a longer run needs the short last shard (1 batch) rewritten, not appended to
    cfg["train"]["steps"] = 8
    path = _write(tmp, cfg, "partial.yaml")
    assert main(["cache-teacher", path, "--batches-per-shard", "2"]) == 0
    third = _last_json(capsys)
    assert (third["steps_written"], third["written_now"], third["shards"]) == (8, 2, 4)

    # the resumed cache holds the same records as one written in a single pass
    whole = _cache_cfg(online, "whole", top_k=4)
    whole["train"]["steps"] = 8
    whole_path = _write(tmp, whole, "whole.yaml")
    assert main(["cache-teacher", whole_path, "--batches-per-shard", "2"]) == 0
    for i in range(4):
        name = f"train-{i:05d}.arrayrecord"
        assert (cache / name).read_bytes() == (tmp / "whole" / "cache" / name).read_bytes()


def test_errors(online, capsys):
    tmp, _ = online
    cfg = _cache_cfg(online, "errors")
    cfg["train"]["steps"] = 2
    path = _write(tmp, cfg, "errors.yaml")

    def error(argv) -> str:
        capsys.readouterr()
        assert main(argv) == 2
        return capsys.readouterr().err.strip()

    assert "teacher.top_k" in error(["cache-teacher", path, "--set", "teacher.top_k=null"])
    run_cache = ["run", path, "--set", "teacher.source=cache"]
    assert "no teacher cache" in error(run_cache)
    assert main(["cache-teacher", path]) == 0
    for override, field in (
        ("teacher.top_k=4", "teacher.top_k"),
        ("distill.temperature=1.0", "distill.temperature"),
        ("train.seq_len=16", "train.seq_len"),
        ("train.batch_size=2", "train.batch_size"),
        ("run.seed=1", "run.seed"),
    ):
        msg = error(["cache-teacher", path, "--set", override])
        assert msg.startswith(f"distill: error: {field}:") and "\n" not in msg, msg
        msg = error([*run_cache, "--set", override])
        assert msg.startswith(f"distill: error: {field}:"), msg
    msg = error([*run_cache, "--set", "train.steps=5"])
    assert msg.startswith("distill: error: train.steps:") and "holds 2" in msg
    # a different teacher: same shapes, other weights
    other = _cache_cfg(online, "errors")
    other["teacher"].update(checkpoint=str(tmp / "other_teacher"), pretrain_steps=1)
    other["train"]["steps"] = 2
    msg = error(["cache-teacher", _write(tmp, other, "other.yaml")])
    assert msg.startswith("distill: error: teacher.checkpoint: teacher_hash"), msg
    assert not (tmp / "errors" / "checkpoints").exists()  # nothing ran on the devices
