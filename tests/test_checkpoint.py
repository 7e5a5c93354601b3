"""Resuming past a latest checkpoint that cannot be read: real Orbax checkpoints of a small
TrainState, the newest one damaged the way disks and copies damage files. The resume takes
the previous checkpoint exactly, warns in one line, sets the damaged step aside unchanged,
and retention never deletes the last readable checkpoint."""

import functools
import logging
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from distill.checkpoint import UNREADABLE, Checkpointer
from distill.config import ModelConfig, OptimConfig
from distill.errors import DistillError
from student import optim, train

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
TX = optim.make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), 10)


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("dp",))


@functools.cache
def _state(seed: int) -> train.TrainState:
    """A distinct state per step: parameters initialised from the step as the seed (made
    once per seed: each init traces its own program; the arrays are immutable)."""
    return train.init_state(CFG, TX, seed, _mesh())


def _save(directory: Path, steps, keep: int = 3) -> None:
    ckpt = Checkpointer(str(directory), keep=keep)
    for step in steps:
        ckpt.save(step, _state(step), {"next": step})
    ckpt.close()


def _restore(directory: Path, keep: int = 3, cfg: ModelConfig = CFG):
    ckpt = Checkpointer(str(directory), keep=keep)
    try:
        return ckpt.restore(train.abstract_state(cfg, TX, _mesh()))
    finally:
        ckpt.close()


def _assert_state(restored, seed: int) -> None:
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(_state(seed))
    )


def _files(step_dir: Path) -> dict:
    return {
        str(p.relative_to(step_dir)): p.read_bytes() for p in step_dir.rglob("*") if p.is_file()
    }


def _truncate_array_files(step_dir: Path) -> None:
    """A disk that filled: the array data files (OCDBT's `d/`) cut in half. All of them:
    OCDBT may spread the arrays over several files, not all read for the state."""
    for path in (p for p in (step_dir / "state").rglob("*") if p.parent.name == "d"):
        path.write_bytes(path.read_bytes()[: _size(path) // 2])


def _size(path: Path) -> int:
    return path.stat().st_size


def _rot_tree_metadata(step_dir: Path) -> None:
    """Bit rot in the state's tree metadata."""
    path = step_dir / "state" / "_METADATA"
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4] = b"\xff\x00\xfe\x81"
    path.write_bytes(bytes(data))


def _drop_manifest(step_dir: Path) -> None:
    """A partial copy from a bucket: the array store's manifest never arrived."""
    (step_dir / "state" / "manifest.ocdbt").unlink()


def _garble_data_state(step_dir: Path) -> None:
    """The data-iterator state (JSON) truncated."""
    path = step_dir / "data" / "metadata"
    path.write_bytes(path.read_bytes()[:3])


DAMAGES = [_truncate_array_files, _rot_tree_metadata, _drop_manifest, _garble_data_state]


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "distill" and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.strip("_"))
def test_resume_skips_an_unreadable_latest_checkpoint(tmp_path, caplog, damage):
    _save(tmp_path, [3, 6])
    damage(tmp_path / "6")
    damaged = _files(tmp_path / "6")
    with caplog.at_level(logging.WARNING, logger="distill"):
        state, data_state, step = _restore(tmp_path)
    # exactly as if step 6 had never been written
    assert (step, data_state) == (3, {"next": 3})
    _assert_state(state, 3)
    (line,) = _warnings(caplog)
    assert "step 6 cannot be read, using step 3" in line and "\n" not in line
    assert f"6{UNREADABLE}1" in line and line.split(": ", 1)[1]  # where to, and why
    # set aside unchanged, out of Orbax's sight; step 6 can be saved again
    assert not (tmp_path / "6").exists()
    assert _files(tmp_path / f"6{UNREADABLE}1") == damaged
    ckpt = Checkpointer(str(tmp_path))
    assert ckpt.latest_step() == 3
    ckpt.save(6, _state(60), {"next": 6})
    ckpt.close()
    state, data_state, step = _restore(tmp_path)
    assert (step, data_state) == (6, {"next": 6})
    _assert_state(state, 60)


def test_an_explicit_step_is_restored_or_fails_as_is(tmp_path):
    _save(tmp_path, [3, 6])
    _drop_manifest(tmp_path / "6")
    ckpt = Checkpointer(str(tmp_path))
    abstract = train.abstract_state(CFG, TX, _mesh())
    assert ckpt.restore(abstract, step=3)[1:] == ({"next": 3}, 3)
    with pytest.raises(ValueError, match="NOT_FOUND"):
        ckpt.restore(abstract, step=6)
    ckpt.close()
    assert (tmp_path / "6").exists()


def test_no_readable_checkpoint_is_one_distill_error_and_moves_nothing(tmp_path):
    _save(tmp_path, [3, 6])
    _truncate_array_files(tmp_path / "6")
    _drop_manifest(tmp_path / "3")
    with pytest.raises(DistillError) as err:
        _restore(tmp_path)
    message = str(err.value)
    assert message.startswith("run.output_dir: ") and "\n" not in message
    assert str(tmp_path) in message and "(steps 6, 3)" in message
    assert "step 6: ValueError: " in message and "tensorstore_spec" not in message
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["3", "6"]


def test_a_target_that_fits_no_checkpoint_moves_nothing(tmp_path):
    """A changed model fails on every step: a DistillError, never a reason to set the
    (readable) checkpoints aside."""
    _save(tmp_path, [3, 6])
    with pytest.raises(DistillError, match="can be restored"):
        _restore(tmp_path, cfg=CFG.model_copy(update={"d_model": 32}))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["3", "6"]


def test_a_step_set_aside_twice_keeps_both(tmp_path):
    _save(tmp_path, [3, 6])
    for n in (1, 2):
        _drop_manifest(tmp_path / "6")
        assert _restore(tmp_path)[2] == 3
        assert (tmp_path / f"6{UNREADABLE}{n}" / "state").is_dir()
        if n == 1:
            _save(tmp_path, [6])
    assert {p.name for p in tmp_path.iterdir()} >= {"3", f"6{UNREADABLE}1", f"6{UNREADABLE}2"}
    assert not (tmp_path / "6").exists()


def _writes_settled(directory: Path, quiet_s: float = 0.5, limit_s: float = 60) -> None:
    """Wait until no file under `directory` appears, goes or changes size for `quiet_s`:
    the array writes of a save whose metadata failed go on in their own threads."""

    def files() -> set:
        return {(str(p), p.stat().st_size) for p in directory.rglob("*") if p.is_file()}

    end, last = time.monotonic() + limit_s, None
    while time.monotonic() < end:
        now = files()
        if now == last:
            return
        last = now
        time.sleep(quiet_s)
    raise AssertionError(f"files under {directory} still changing after {limit_s} s")


def test_retention_never_deletes_the_last_readable_checkpoint(tmp_path):
    """keep=1 after a resume from step 3 past an unreadable 6: a save that fails leaves
    step 3 in place; the next run's save replaces it once written; the step set aside is
    never counted nor deleted by Orbax's retention."""
    _save(tmp_path, [3, 6], keep=2)
    _truncate_array_files(tmp_path / "6")
    aside = f"6{UNREADABLE}1"

    def steps() -> set:
        return {p.name for p in tmp_path.iterdir() if p.name[0].isdigit() and "orbax" not in p.name}

    abstract = train.abstract_state(CFG, TX, _mesh())
    ckpt = Checkpointer(str(tmp_path), keep=1)
    assert ckpt.restore(abstract)[2] == 3 and steps() == {"3", aside}
    with pytest.raises(TypeError, match="JSON serializable"):  # the async write fails
        ckpt.save(6, _state(60), {"next": object()})
        ckpt.wait()
    assert steps() == {"3", aside}
    _assert_state(ckpt.restore(abstract, step=3)[0], 3)
    del ckpt  # a run whose save failed dies; the rerun resumes from step 3 again
    _writes_settled(tmp_path)  # a dead process writes nothing more; this one's threads may
    ckpt = Checkpointer(str(tmp_path), keep=1)
    assert ckpt.restore(abstract)[2] == 3
    ckpt.save(6, _state(60), {"next": 6})
    ckpt.wait()
    assert steps() == {"6", aside}
    ckpt.save(9, _state(90), {"next": 9})
    ckpt.close()
    assert steps() == {"9", aside}
    state, data_state, step = _restore(tmp_path, keep=1)
    assert (step, data_state) == (9, {"next": 9})
    _assert_state(state, 90)
