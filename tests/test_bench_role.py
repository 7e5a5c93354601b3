"""`distill bench --role`: one role alone on the host's first devices, on a config whose two
meshes together would not fit (teacher tp=4 + student dp=4 x fsdp=2 on 8 devices)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.config.load import config_from_dict
from distill.mesh import role_mesh
from distill.types import TeacherOutput
from pipelines.bench import role as role_bench
from pipelines.bench.role import _block_rows, _dense_fits, random_outputs
from pipelines.commands.cli import main
from student.remat import train_flops_per_token
from tests.conftest import tiny_config, write_config

TOO_BIG_FOR_BOTH = {"teacher": {"tp": 4}, "student": {"dp": 4, "fsdp": 2}}


def _bench(tmp_path, corpus_dir, capsys, *args, **sections):
    sections = {"mesh": TOO_BIG_FOR_BOTH, **sections}
    sections["train"] = {"batch_size": 8, **sections.get("train", {})}
    cfg = tiny_config(str(corpus_dir), str(tmp_path / "out"), **sections)
    code = main(["bench", write_config(tmp_path, cfg), "--repeats", "2", *args])
    out = capsys.readouterr()
    return code, out


def test_a_run_of_this_layout_is_refused(tmp_path, corpus_dir, capsys):
    code, out = _bench(tmp_path, corpus_dir, capsys)
    assert code == 2 and "needs 12 devices, but only 8" in out.err


@pytest.mark.parametrize("role", ["teacher", "student"])
def test_one_role_alone(tmp_path, corpus_dir, capsys, role):
    """Each variant timed, tokens/s, MFU against the measured matmul rate, the compiled
    memory; nothing written (random weights, no bootstrap). The student's steps accumulate
    two microbatches with rematerialised blocks, as the training loop's would."""
    train = {"batch_size": 16, "grad_accum": 2, "remat": "block"} if role == "student" else {}
    code, out = _bench(tmp_path, corpus_dir, capsys, "--role", role, train=train)
    assert code == 0, out.err
    text, result = out.out.strip().splitlines(), json.loads(out.out.strip().splitlines()[-1])
    assert result["role"] == role
    if role == "teacher":
        assert result["mesh"] == {"dp": 1, "ep": 1, "tp": 4}
        keys = ("teacher_plain_ms", "teacher_dense_ms", "teacher_topk_ms", "teacher_ms")
        mfu, mem = result["teacher_mfu"], result["teacher_forward_temp_bytes_per_device"]
    else:
        assert result["mesh"] == {"dp": 4, "fsdp": 2}
        keys = ("student_ce_ms", "student_kd_dense_ms", "student_kd_topk_ms", "student_ms")
        mfu, mem = result["mfu"], result["student_step_temp_bytes_per_device"]
        assert result["student_remat"] == "block" and result["student_remat"] in text[1]
        cfg = config_from_dict(tiny_config("unused", "unused"))
        shape = (cfg.student_model(), cfg.train.seq_len)
        recompute = train_flops_per_token(*shape, "block") / train_flops_per_token(*shape, "none")
        assert recompute > 1 and result["hfu"] == pytest.approx(
            mfu * recompute, abs=2e-4
        )  # 4 decimals
    assert all(result[k] > 0 for k in keys)
    assert result[f"{role}_tokens_per_s"] == pytest.approx(
        result["tokens_per_step"] / (result[f"{role}_ms"] / 1e3), rel=1e-3
    )
    assert 0 < mfu < 1.5 and mem > 0
    assert text[0].startswith(f"{role} alone on")
    assert not (tmp_path / "out").exists()


def test_role_with_a_two_role_option_is_one_line(tmp_path, corpus_dir, capsys):
    code, out = _bench(tmp_path, corpus_dir, capsys, "--role", "teacher", "--cache")
    assert code == 2 and "--role" in out.err and "--cache" in out.err


def test_a_role_too_big_for_the_host_is_one_line(tmp_path, corpus_dir, capsys):
    mesh = {"teacher": {"dp": 4, "tp": 4}, "student": {"dp": 4}}
    code, out = _bench(tmp_path, corpus_dir, capsys, "--role", "teacher", mesh=mesh)
    assert code == 2 and "mesh.teacher:" in out.err and "needs 16 devices" in out.err


def _student(corpus_dir, tmp_path, batch_size=8):
    cfg = config_from_dict(
        tiny_config(
            str(corpus_dir),
            str(tmp_path / "out"),
            mesh=TOO_BIG_FOR_BOTH,
            train={"batch_size": batch_size},
        )
    )
    return cfg, role_mesh(cfg, "student")


@pytest.mark.parametrize("elements", [None, 32 * 260 + 1])
def test_random_outputs_are_teacher_shaped(corpus_dir, tmp_path, monkeypatch, elements):
    """Dense log-probs normalised over the live ids (padded ids -inf, as the teacher gives
    them), and their exact top-k, on the student's batch sharding; made whole, or (a bound
    of one 32 x 260 row a call) a row at a time, each row its own."""
    cfg, mesh = _student(corpus_dir, tmp_path, batch_size=16)
    if elements:
        monkeypatch.setattr(role_bench, "MAX_ELEMENTS", elements)
    outs = random_outputs(cfg, mesh, limit=259)
    dense = np.asarray(outs["dense"].logprobs)
    b, s, v = cfg.train.batch_size, cfg.train.seq_len, cfg.teacher.model.vocab_size
    assert dense.shape == (b, s, v) and np.all(np.isneginf(dense[..., 259:]))
    np.testing.assert_allclose(np.exp(dense[..., :259]).sum(-1), 1.0, rtol=1e-5)
    top, ids = np.asarray(outs["topk"].logprobs), np.asarray(outs["topk"].ids)
    assert top.shape == ids.shape == (b, s, cfg.teacher.top_k) and ids.max() < 259
    np.testing.assert_array_equal(np.take_along_axis(dense, ids, -1), top)
    np.testing.assert_array_equal(top, -np.sort(-dense, -1)[..., : cfg.teacher.top_k])
    assert outs["topk"].ids.sharding.is_equivalent_to(outs["dense"].logprobs.sharding, 3)
    assert len(jax.tree.leaves(outs)) == 3 and outs["dense"].logprobs.dtype == jnp.float32
    assert len({row.tobytes() for row in top}) == b  # no two rows (or blocks) alike
    alone = random_outputs(cfg, mesh, limit=259, dense=False)
    assert set(alone) == {"topk"}
    np.testing.assert_array_equal(np.asarray(alone["topk"].ids), ids)


def test_block_rows_stay_below_the_32_bit_bound():
    """The bench's crash: 8 rows x 4,096 x 128,256 ids in one top-k (4.2e9 elements)."""
    assert _block_rows(8, 4096 * 128256) == 4  # 2.1e9 < 2^31
    assert _block_rows(6, 4096 * 128256) == 3
    assert _block_rows(8, 2**31) == 1 and _block_rows(5, 7) == 5


def test_dense_kd_is_timed_while_it_fits(corpus_dir, tmp_path):
    """On an accelerator (device memory known) the dense variant is timed while each
    device's share of the [B, S, V] log-probs takes at most a quarter of it and stays below
    2^31 elements; its bytes come from the abstract output's shape and dtype (jax 0.11 has
    no ShapeDtypeStruct.nbytes)."""
    cfg, mesh = _student(corpus_dir, tmp_path)
    dense = jax.eval_shape(lambda: random_outputs(cfg, mesh, limit=259))["dense"]
    share = 8 * 32 * 260 * 4 // mesh.size  # bytes per device
    assert _dense_fits(cfg, dense, mesh, 4 * share) and not _dense_fits(
        cfg, dense, mesh, 4 * share - 4
    )
    assert _dense_fits(cfg, dense, mesh, None)  # CPU: memory unknown
    huge = TeacherOutput(jax.ShapeDtypeStruct((8 * mesh.size, 4096, 128256), jnp.float32))
    assert not _dense_fits(cfg, huge, mesh, 2**50)  # 4.2e9 elements a device
    dense_run = cfg.model_copy(update={"teacher": cfg.teacher.model_copy(update={"top_k": None})})
    assert _dense_fits(dense_run, dense, mesh, 4)  # the run's own output: always


def test_staged_teacher_reports_its_measured_bubble(tmp_path, corpus_dir, capsys):
    """pp=2 x tp=2 in 4 microbatches of 2 rows: the stages' loop timed on the batch and on
    the batch twice over, the bubble measured from the two beside the schedule's 1/5.
    (Simulated CPU devices share the cores, so here it measures ticks, not overlap.)"""
    mesh = {"teacher": {"pp": 2, "tp": 2}, "student": {"dp": 4, "fsdp": 2}}
    code, out = _bench(
        tmp_path, corpus_dir, capsys, "--role", "teacher", mesh=mesh, teacher={"microbatch": 2}
    )
    assert code == 0, out.err
    text, result = out.out.strip().splitlines(), json.loads(out.out.strip().splitlines()[-1])
    assert result["mesh"] == {"pp": 2, "dp": 1, "ep": 1, "tp": 2}
    assert result["microbatches"] == 4 and result["bubble_predicted"] == pytest.approx(0.2)
    # timings on shared cores: their values vary (a loaded machine can even time the
    # doubled batch faster), so the check is that both were timed and how they combine
    loop, loop2 = result["stage_loop_ms"], result["stage_loop_2x_ms"]
    assert loop > 0 and loop2 > 0
    assert result["bubble_measured"] == pytest.approx(2 - loop2 / loop, abs=1e-3)
    assert any(line.startswith("stages: loop ") for line in text)
