"""Role groups across processes (`mesh.<role>.hosts`) on a real local Ray cluster, with what
a real run sets: a Hugging Face teacher directory, read by each process only for its devices'
slices, in a group of 2 processes x 2 CPU devices (tp = 4 across both, more than its 2 KV
heads) in 2-row microbatches; a student group of 2 processes x 2 CPU devices (dp = 2 x
fsdp = 2) with 2 accumulated microbatches and rematerialised blocks; half the steps
on-policy; evaluation in two chunks. Each is its own JAX distributed system with gloo
collectives and gives the local mode's losses, evaluation and sample metrics; a killed
process takes its group down and the group is recreated; a full stop resumes exactly. A
teacher in 2 pipeline stages, one per process (`mesh.teacher.pp`), does the same."""

import warnings

import pytest
import yaml

from pipelines.commands.cli import main
from tests.conftest import kill_process as _kill
from tests.conftest import read_summary as _summary
from tests.conftest import run_with_fault, tiny_config, write_config
from tests.conftest import train_by_step as _train
from tests.test_cross_context import (
    assert_same_as_cp_1,
    cross_cp_1,  # noqa: F401 (the local run compared against)
    with_cp,
)

ray = pytest.importorskip("ray")
pytest.importorskip("pipelines.ray.mode")

KEYS = ("loss", "kd_loss", "ce_loss", "lr")
SAMPLE_KEYS = ("sample_teacher_nll", "sample_student_nll", "sample_len")
MESH = {"teacher": {"tp": 4}, "student": {"dp": 2, "fsdp": 2}}
GROUPS = {role: {**axes, "hosts": 2} for role, axes in MESH.items()}
TEACHER = {"microbatch": 2}  # with the checkpoint: the module's Hugging Face directory
TRAIN = {"batch_size": 8, "grad_accum": 2, "remat": "block"}
# half the steps on-policy: the student group samples its rows of the prompts with the
# parameters of two steps back (kept by every process), the teacher group scores them; the
# random teacher may be no better than the student, whose gate would make them data steps
ON_POLICY = {"on_policy": {"fraction": 0.5, "max_new_tokens": 8}, "alpha_gate": False}
# two eval chunks: the second's teacher forward overlaps the first's evaluation, and each
# student process receives only its rows of the teacher's logits
DATA = {"eval_batches": 2}


@pytest.fixture(scope="module")
def ray_cluster():
    with warnings.catch_warnings():  # fork+exec of Ray's processes, safe with JAX loaded
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        # the roles' host resources, as a KubeRay worker group per role offers them (here all
        # on the one node): the groups' placement asks for them
        hosts = {"teacher_host": 4, "student_host": 2}  # up to 2 teacher groups of 2
        ray.init(num_cpus=6, resources=hosts, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(tmp_path, cfg: dict, fault=None) -> int:
    """The run's exit status; `fault(step, pool)` after each student step's dispatch."""
    if fault is not None:
        return run_with_fault(tmp_path, cfg, fault)
    return main(["run", write_config(tmp_path, cfg)])


def _hf_teacher(out) -> str:
    """The Hugging Face teacher directory beside a local run's output directory."""
    return str(out.parent / "hf")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, corpus_dir):
    """Local mode, the same layout (teacher tp=4, student dp=2 x fsdp=2) on 8 devices of
    one process, from a random Llama teacher saved by transformers."""
    pytest.importorskip("transformers")
    from tests.test_hf import _save_llama

    tmp = tmp_path_factory.mktemp("local")
    out = tmp / "out"
    _save_llama(_hf_teacher(out), vocab_size=260, num_attention_heads=4, num_key_value_heads=2)
    cfg = tiny_config(
        str(corpus_dir), str(out), mesh=MESH, teacher={**TEACHER, "checkpoint": _hf_teacher(out)},
        train=TRAIN, distill=ON_POLICY, data=DATA,
    )  # fmt: skip
    assert _run(tmp, cfg) == 0
    return out


def _groups_config(corpus_dir, out, local_out, **sections) -> dict:
    cfg = tiny_config(
        str(corpus_dir),
        str(out),
        pipeline={"mode": "ray"},
        mesh=GROUPS,
        teacher={**TEACHER, "checkpoint": _hf_teacher(local_out)},
        train=TRAIN,
        distill=ON_POLICY,
        data=DATA,
    )
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def _assert_same_losses(out, local_out) -> None:
    """The local run's losses within float tolerance: the reductions across processes
    (gloo) may sum in another order than one process's."""
    ray_records, local_records = _train(out), _train(local_out)
    assert sorted(ray_records) == sorted(local_records) == [2, 4, 6]
    for step, expected in local_records.items():
        for key in KEYS:
            assert ray_records[step][key] == pytest.approx(expected[key], rel=1e-4), (step, key)
    assert any(r["on_policy"] > 0 for r in ray_records.values())
    final, local_final = _summary(out)["final_eval"], _summary(local_out)["final_eval"]
    for key in ("teacher_loss", "student_loss", "kl", "student_bpb", *SAMPLE_KEYS):
        assert final[key] == pytest.approx(local_final[key], rel=1e-4), key
    assert local_final["sample_len"] > 0


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["mesh.teacher.hosts=2"], "mesh.teacher.hosts: 2 processes need pipeline.mode ray"),
        (["mesh.student.hosts=2"], "mesh.student.hosts: 2 processes need pipeline.mode ray"),
        (
            ["pipeline.mode=ray", "mesh.teacher.hosts=3"],
            "mesh.teacher.hosts: 3 does not divide the 2 devices of mesh.teacher.tp=2",
        ),
    ],
)
def test_bad_hosts_are_one_line(corpus_dir, tmp_path, capsys, overrides, expected):
    """Local mode is one process; a group's devices split evenly over its processes."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(str(corpus_dir), str(tmp_path / "out"))))
    args = [a for o in overrides for a in ("--set", o)]
    for command in ("validate", "run"):
        assert main([command, str(cfg), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"distill: error: {expected}"), err


# the student process holding each row shard: host by host, interleaved, out of order
OWNERS = [(0,), (0, 1), (0, 1, 2, 3), (0, 1, 0, 1), (1, 0, 0, 1)]


@pytest.mark.parametrize("owners", OWNERS)
def test_rows_between_groups_cover_each_student_process_rows(owners):
    """A batch split into each student process's rows (one block or several) and joined
    again is the batch; a teacher's pieces of one process's rows are checked to cover
    them exactly."""
    import numpy as np

    from distill.types import Batch, TeacherOutput
    from pipelines.ray import rows as ray_rows

    batch = Batch(*(np.arange(8 * 3).reshape(8, 3) + i for i in range(5)))
    parts = ray_rows.split_batch(batch, owners)
    assert len(parts) == max(owners) + 1
    for p, part in enumerate(parts):
        mine = ray_rows.spans(owners, p, 8)
        assert (part.tokens == np.concatenate([batch.tokens[a:b] for a, b in mine])).all()
    joined = ray_rows.join_batch(parts, owners)
    assert joined.teacher is None  # no teacher rows of its own (one tokenizer)
    assert all((x == y).all() for x, y in zip(joined[:5], batch[:5], strict=True))
    out = TeacherOutput(np.arange(8 * 2, dtype=np.float32).reshape(8, 2), None)
    mine = ray_rows.spans(owners, max(owners), 8)
    pieces = [[((a, 0), TeacherOutput(out.logprobs[a : a + 1], None))] for lo, hi in mine
              for a in range(lo, hi)][::-1]  # fmt: skip
    rows, nbytes = ray_rows.student_rows(pieces, mine)
    assert (rows.logprobs == ray_rows.take(out.logprobs, mine)).all()
    assert nbytes == rows.logprobs.nbytes
    with pytest.raises(RuntimeError, match="do not cover"):
        ray_rows.student_rows(pieces[1:], mine)


def test_spans_merge_a_process_adjacent_shards():
    from pipelines.ray.rows import spans

    assert spans((0, 0, 1, 1), 0, 8) == [(0, 4)]
    assert spans((0, 1, 1, 0), 0, 8) == [(0, 2), (6, 8)]
    assert spans((0, 1, 1, 0), 1, 4) == [(1, 3)]


@pytest.mark.parametrize("owners", [(0, 1, 2, 3), (1, 0, 3, 2), (0, 0, 1, 1)])
@pytest.mark.parametrize("layout", ["tp", "staged", "cp"])
def test_teacher_parts_send_each_row_once(owners, layout):
    """A teacher output replicated over tp (rows split over dp only), with pipeline stages
    split over every device (`OUT_ROWS_PP`: each stage 1/pp of the rows), or with the
    teacher's cp each row's positions split too (`P(rows, cp)`: blocks of rows x
    positions, sent as they are, never whole rows), goes to the student processes as
    `owners` says, each row and position once, from the devices' own buffers."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from distill.types import TeacherOutput
    from pipelines.ray import rows as ray_rows
    from teacher.sharding import OUT_ROWS_PP

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    values = np.arange(8 * 4 * 2, dtype=np.float32).reshape(8, 4, 2)
    split = NamedSharding(mesh, P("dp"))
    if layout == "staged":
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 1, 4), ("pp", "dp", "ep", "tp"))
        split = NamedSharding(mesh, OUT_ROWS_PP)
    if layout == "cp":  # rows over dp x tp, positions over cp (`teacher.sharding.out_spec`)
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "cp", "tp"))
        split = NamedSharding(mesh, P(("dp", "tp"), "cp"))
    out = TeacherOutput(
        jax.device_put(values, split), jax.device_put(values.astype(np.int32), split)
    )
    parts = ray_rows.teacher_parts(out, owners)
    for p, part in enumerate(parts):
        mine = ray_rows.spans(owners, p, 8)
        if layout == "cp":  # each piece half a row's positions
            assert {piece.logprobs.shape[1] for _, piece in part} == {2}
        rows, nbytes = ray_rows.student_rows([part[::-1]], mine)  # in any order
        assert (rows.logprobs == ray_rows.take(values, mine)).all()
        assert (rows.ids == ray_rows.take(values, mine)).all()
        assert nbytes == sum(b - a for a, b in mine) * 8 * 8
        if layout == "cp":  # a missing block of positions is noticed
            with pytest.raises(RuntimeError, match="do not cover"):
                ray_rows.student_rows([part[1:]], mine)


@pytest.mark.parametrize("owners", [(0, 1, 2, 3), (1, 0, 3, 2)])
def test_eval_windows_reach_each_student_process_once(owners):
    """Eval logits in position windows (`eval_windows`, a tuple) go to the student processes
    window by window, each its rows of every window in order, as the whole logits' rows
    would (`StudentMember.evaluate` tells them apart by `is_windowed`)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pipelines.ray import rows as ray_rows

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"))
    values = np.arange(8 * 6 * 2, dtype=np.float32).reshape(8, 6, 2)
    windows = tuple(jax.device_put(values[:, j::3], NamedSharding(mesh, P("dp"))) for j in range(3))
    parts = ray_rows.window_parts(windows, owners)
    assert len(parts) == 4 and ray_rows.is_windowed((parts[0],))
    assert not ray_rows.is_windowed(([],)) and not ray_rows.is_windowed((tuple(windows),))
    for p, part in enumerate(parts):
        mine = ray_rows.spans(owners, p, 8)
        got, nbytes = ray_rows.student_window_rows([part], mine)
        for j, window in enumerate(got):
            assert (window == ray_rows.take(values, mine)[:, j::3]).all()
        assert nbytes == sum(b - a for a, b in mine) * 6 * 2 * 4


def _corpus(corpus_dir):
    from distill.config.load import config_from_dict
    from distill.data.loader import load_corpus

    cfg = config_from_dict(tiny_config(str(corpus_dir), "unused"))
    return cfg, load_corpus(cfg.data, cfg.train.seq_len)


def test_each_process_reads_its_rows_of_the_iterators_batch(corpus_dir):
    """Read by data state, any rows of a batch are those rows of the batch the driver's
    Grain iterator yields at that state, on any host count and layout (the data per
    host)."""
    import numpy as np

    from pipelines.ray import rows as ray_rows

    cfg, corpus = _corpus(corpus_dir)
    reader = ray_rows.BatchReader(corpus, 4, cfg.run.seed)
    it = corpus.train_iterator(4, cfg.run.seed)
    for _ in range(3 * corpus.train_rows // 4):  # past an epoch: reshuffled
        state, batch = it.get_state(), next(it)
        for owners in OWNERS:
            rows = [
                reader.rows(state, ray_rows.spans(owners, p, 4)) for p in range(max(owners) + 1)
            ]
            for field, whole in zip(ray_rows.join_batch(rows, owners), batch, strict=True):
                np.testing.assert_array_equal(field, whole)
    other = ray_rows.BatchReader(corpus, 4, cfg.run.seed + 1)
    assert ray_rows.data_check(other) != ray_rows.data_check(reader)


def test_teacher_process_batch_is_the_global_batch(corpus_dir):
    """`global_batch` (what a teacher process puts on its mesh, reading only the rows of its
    devices) is the batch the iterator yields, on a dp x tp mesh and on a dp x cp x tp one
    (each device its positions of its rows)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pipelines.ray import rows as ray_rows

    cfg, corpus = _corpus(corpus_dir)
    reader = ray_rows.BatchReader(corpus, 4, cfg.run.seed)
    state = {"next_index": 5}
    plain = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    context = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "cp", "tp"))
    for split in (NamedSharding(plain, P("dp")), NamedSharding(context, P("dp", "cp"))):
        batch = ray_rows.global_batch(reader, state, split)
        for got, want in zip(batch, reader.rows(state), strict=True):
            if want is None:  # no teacher rows of its own (one tokenizer)
                assert got is None
                continue
            assert got.shape == want.shape and got.sharding == split
            np.testing.assert_array_equal(np.asarray(got), want)


def test_a_raw_corpus_read_by_many_processes_is_worth_a_warning(tmp_path, caplog):
    """Every actor process tokenises data.source itself: the driver says so, and points at
    distill prepare, once more than two processes would."""
    from distill.config.load import config_from_dict
    from pipelines.ray.mode import _warn_raw_corpus, actor_processes

    def _warn(cfg):
        _warn_raw_corpus(cfg, actor_processes(cfg))

    mesh = {"teacher": {"tp": 2, "hosts": 2}, "student": {"dp": 2, "hosts": 2}}
    tree = tiny_config(str(tmp_path), str(tmp_path / "out"), mesh=mesh)
    tree["pipeline"] = {"mode": "ray"}
    _warn(config_from_dict(tree))
    assert "each of the 4 actor processes tokenises data.source itself" in caplog.text
    caplog.clear()
    tree["data"]["prepared_dir"] = str(tmp_path / "prepared")
    _warn(config_from_dict(tree))
    tree["data"]["prepared_dir"], tree["mesh"] = None, MESH  # one process per role
    _warn(config_from_dict(tree))
    assert caplog.text == ""


@pytest.mark.ray
def test_groups_match_local(ray_cluster, local_run, corpus_dir, tmp_path, monkeypatch):
    """The groups' run matches local mode's through the death of a teacher process (not the
    group's coordinator) at step 2: its group is recreated and the step retried."""
    statuses, free_hosts = [], []

    def record_and_kill_teacher(step, pool):
        statuses.append(pool.store.status())
        free_hosts.append(ray.available_resources().get("student_host", 0))
        if step == 2:
            _kill(pool.info["teacher-0"]["processes"][1]["pid"])

    out = tmp_path / "out"
    cfg = _groups_config(corpus_dir, out, local_run)
    assert _run(tmp_path, cfg, record_and_kill_teacher) == 0
    _assert_same_losses(out, local_run)
    records, summary = _train(out), _summary(out)
    assert records[6]["bytes_per_token"] == 8 * 8  # each row once: top-8 float32 + int32 ids
    assert summary["bytes_per_step"] == 8 * 8 * 8 * 32
    assert summary["hosts"] == {"teacher": 2, "student": 2}
    assert summary["completed"] and summary["actor_restarts"] == {"teacher": 1, "student": 0}
    assert statuses[0]["restarts"] == 0 and statuses[-1]["restarts"] == 1
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == ["3", "6"]
    assert free_hosts[-1] == 0  # both student processes hold a student_host
    rows = statuses[-1]["actors"]
    assert [(a["role"], a["hosts"]) for a in rows] == [("teacher", 2), ("student", 2)]
    for a in rows:
        assert a["alive"] and a["node"] and a["devices"] == "cpu:0,1;2048,2049"


def _run_matching_local(tmp_path, corpus_dir, local_run, fault=None) -> dict:
    """Run the groups' config (`fault` as `_run`'s); its losses are the local run's. The
    run's summary."""
    out = tmp_path / "out"
    assert _run(tmp_path, _groups_config(corpus_dir, out, local_run), fault) == 0
    _assert_same_losses(out, local_run)
    return _summary(out)


@pytest.mark.ray
@pytest.mark.slow
def test_killed_teacher_coordinator_recreates_its_group(
    ray_cluster, local_run, corpus_dir, tmp_path, monkeypatch
):
    """Process 0 runs the group's JAX coordinator: killing it takes the group down like any
    member's death (test_groups_match_local kills another member; the others are stopped,
    not left waiting on it)."""

    def kill_teacher(step, pool):
        if step == 2:
            _kill(pool.info["teacher-0"]["processes"][0]["pid"])

    summary = _run_matching_local(tmp_path, corpus_dir, local_run, kill_teacher)
    assert summary["actor_restarts"] == {"teacher": 1, "student": 0}


@pytest.mark.ray
@pytest.mark.slow
def test_teacher_process_lost_at_evaluation_recreates_its_group(
    ray_cluster, local_run, corpus_dir, tmp_path, monkeypatch
):
    """A teacher process killed as the first evaluation asks for the teacher's logits: the
    group is recreated and the chunks recomputed, the same losses and metrics."""
    from pipelines.ray.pool import ActorPool

    plain = ActorPool.eval_teacher_logits

    def kill_then_evaluate(pool, batches):
        if not pool.restarts["teacher"]:
            _kill(pool.info["teacher-0"]["processes"][1]["pid"])
        yield from plain(pool, batches)

    monkeypatch.setattr(ActorPool, "eval_teacher_logits", kill_then_evaluate)
    summary = _run_matching_local(tmp_path, corpus_dir, local_run)
    assert summary["actor_restarts"] == {"teacher": 1, "student": 0}


@pytest.mark.ray
@pytest.mark.slow
def test_a_student_group_holding_interleaved_rows_matches_local(
    ray_cluster, corpus_dir, tmp_path, monkeypatch
):
    """Student dp=3 x fsdp=2 over 2 hosts of 3 devices: dp does not divide the hosts, so
    fsdp crosses them and the hosts interleave: each student process holds row shards
    0, 2, 4 or 1, 3, 5 of every batch (three blocks, as on a TPU slice laid out as one
    torus). Reading, receiving and sending just those rows gives local mode's losses,
    evaluation and sample metrics."""
    owners = []
    record = lambda step, pool: owners.append(pool.owners)  # noqa: E731
    mesh = {"teacher": {"tp": 2}, "student": {"dp": 3, "fsdp": 2}}
    outs = {"local": tmp_path / "local", "ray": tmp_path / "ray"}
    for mode in outs:
        cfg = tiny_config(
            str(corpus_dir), str(outs[mode]), mesh=mesh, train={"batch_size": 6},
            data=DATA, distill=ON_POLICY, pipeline={"mode": mode},
        )  # fmt: skip
        if mode == "ray":
            cfg["mesh"]["student"]["hosts"] = 2
            cfg["teacher"] = {
                **cfg.get("teacher", {}),
                "checkpoint": str(outs["local"] / "teacher"),
            }
        assert _run(tmp_path, cfg, record if mode == "ray" else None) == 0
    _assert_same_losses(outs["ray"], outs["local"])
    assert set(owners) == {(0, 1, 0, 1, 0, 1)}
    assert _train(outs["ray"])[6]["bytes_per_token"] == 8 * 8  # each row once


@pytest.mark.ray
@pytest.mark.slow
def test_two_teacher_groups(ray_cluster, local_run, corpus_dir, tmp_path):
    """teacher.replicas=2, each a whole group of 2 processes (4 teacher processes): the
    batches alternate between the groups, the same losses."""
    out = tmp_path / "out"
    cfg = _groups_config(corpus_dir, out, local_run, teacher={"replicas": 2})
    assert _run(tmp_path, cfg) == 0
    _assert_same_losses(out, local_run)
    summary = _summary(out)
    assert summary["teacher_replicas"] == 2 and summary["hosts"]["teacher"] == 2


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("process", [1, 0])  # 0: the group's coordinator
def test_killed_student_process_resumes_its_group(
    ray_cluster, local_run, corpus_dir, tmp_path, monkeypatch, process
):
    def kill_student(step, pool):
        if step == 5 and not pool.resumed_from:
            assert pool.wait_for_checkpoints() == 3
            _kill(pool.info["student"]["processes"][process]["pid"])

    summary = _run_matching_local(tmp_path, corpus_dir, local_run, kill_student)
    assert summary["actor_restarts"] == {"teacher": 0, "student": 1}
    assert summary["student_resumed_from"] == [3]


@pytest.mark.ray
@pytest.mark.slow
def test_resume_after_full_stop_is_exact(ray_cluster, local_run, corpus_dir, tmp_path, monkeypatch):
    """A run stopped after step 3 (a stop request: a checkpoint, then exit) and run again
    continues from it, every process restoring its shards: the same losses."""

    def stop(step, pool):
        if step == 3:
            pool.store.request_stop()

    out = tmp_path / "out"
    cfg = _groups_config(corpus_dir, out, local_run)
    assert _run(tmp_path, cfg, stop) == 0
    assert not _summary(out)["completed"] and _summary(out)["steps"] == 3
    assert _run(tmp_path, cfg) == 0
    _assert_same_losses(out, local_run)
    assert _summary(out)["completed"]


@pytest.mark.ray
@pytest.mark.slow
def test_resume_on_another_host_count_is_exact(
    ray_cluster, local_run, corpus_dir, tmp_path, monkeypatch
):
    """A run of 2 student processes stopped after step 3 resumes on 1 process of 4 devices
    (the same dp): the checkpoint's one data position is every process's, the global batch
    is the same and only its split differs, and the parameters restore onto the new layout:
    the same losses."""

    def stop(step, pool):
        if step == 3:
            pool.store.request_stop()

    out = tmp_path / "out"
    assert _run(tmp_path, _groups_config(corpus_dir, out, local_run), stop) == 0
    assert _summary(out)["steps"] == 3
    cfg = _groups_config(corpus_dir, out, local_run)
    cfg["mesh"] = {**GROUPS, "student": {**MESH["student"], "hosts": 1}}
    assert _run(tmp_path, cfg) == 0
    _assert_same_losses(out, local_run)
    assert _summary(out)["completed"] and _summary(out)["hosts"]["student"] == 1


@pytest.mark.ray
@pytest.mark.slow
def test_a_colocated_group_of_two_processes_matches_local(
    ray_cluster, local_run, corpus_dir, tmp_path
):
    """`mesh.placement: colocated` across 2 processes: one group holds both roles (the
    teacher's tp=4 and the student's dp=2 x fsdp=2 over the same 4 devices), with on-policy
    steps, microbatches, grad accumulation and two eval chunks; a process killed at step 5
    brings the group back from checkpoint 3. The local split run's losses."""

    def kill_one(step, pool):
        if step == 5 and not pool.resumed_from:
            assert pool.wait_for_checkpoints() == 3
            _kill(pool.info["student"]["processes"][1]["pid"])

    out = tmp_path / "out"
    cfg = _groups_config(corpus_dir, out, local_run)
    cfg["mesh"]["placement"] = "colocated"
    assert _run(tmp_path, cfg, kill_one) == 0
    _assert_same_losses(out, local_run)
    summary = _summary(out)
    assert summary["actor_restarts"] == {"teacher": 0, "student": 1}
    assert summary["student_resumed_from"] == [3] and summary["bytes_per_step"] == 0


# the teacher in 2 pipeline stages of tp = 2, one per process: layer 0 on process 0's
# devices, layer 1 (and its stage's share of the head) on process 1's
STAGES = {"pp": 2, "tp": 2, "hosts": 2}


@pytest.mark.ray
@pytest.mark.slow
def test_teacher_stages_across_processes_match_local(
    ray_cluster, local_run, corpus_dir, tmp_path, monkeypatch
):
    """mesh.teacher.pp=2 over a teacher group of 2 processes: each process one stage, the
    activations passed between them by the group's own collective (a ppermute over gloo), 4
    microbatches of 2 rows; the outputs leave with rows split over both stages' devices,
    each student process getting its rows from whichever stage holds them. The local
    (unstaged) run's losses, through the death of the second stage's process at step 2:
    the group is recreated and the step retried."""
    infos = []

    def kill_stage(step, pool):
        infos.append(pool.info["teacher-0"])
        if step == 2:
            _kill(pool.info["teacher-0"]["processes"][1]["pid"])

    out = tmp_path / "out"
    cfg = _groups_config(corpus_dir, out, local_run)
    cfg["mesh"]["teacher"] = STAGES
    assert _run(tmp_path, cfg, kill_stage) == 0
    _assert_same_losses(out, local_run)
    summary = _summary(out)
    assert summary["actor_restarts"] == {"teacher": 1, "student": 0}
    assert _train(out)[6]["bytes_per_token"] == 8 * 8  # each row once, from one stage
    layout = infos[-1]["layout"]
    assert layout["shape"] == {"pp": 2, "dp": 1, "ep": 1, "tp": 2}
    # stage s is process s's devices
    stages = [d["id"] for d in layout["devices"]]
    assert [p["local_devices"] for p in infos[-1]["processes"]] == [stages[:2], stages[2:]]


@pytest.mark.ray
@pytest.mark.slow
def test_colocated_teacher_stages_across_processes_match_local(
    ray_cluster, local_run, corpus_dir, tmp_path
):
    """`mesh.placement: colocated` with mesh.teacher.pp=2 over 2 processes: each process
    holds one teacher stage (tp = 2) and half the student (dp = 2 x fsdp = 2) on the same
    devices; the teacher's outputs reach the training mesh on device. The local run's
    losses."""
    out = tmp_path / "out"
    cfg = _groups_config(corpus_dir, out, local_run)
    cfg["mesh"]["teacher"] = STAGES
    cfg["mesh"]["placement"] = "colocated"
    assert _run(tmp_path, cfg) == 0
    _assert_same_losses(out, local_run)
    assert _summary(out)["bytes_per_step"] == 0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_cp_across_processes_matches_cp_1(ray_cluster, tiny_run, corpus_dir, tmp_path, placement):
    """Context parallelism in groups of 2 processes: the teacher's tp = 2 x cp = 2 with its
    cp across the processes (each process half of every row's positions) and the student's
    dp = 2 x cp = 2 with its rows' cp devices in one process. Split, each student process
    receives its rows from both teacher processes as rows x positions blocks; colocated,
    the blocks are on the other process's devices, so the group reshards them together.
    The losses and evaluations (with the samples each student process decodes, whole rows
    on its cp devices) of the session's cp = 1 tiny run (teacher tp = 2, student dp = 2) to
    1e-6."""
    infos = []
    record = lambda step, pool: infos.append(pool.info["teacher-0"])  # noqa: E731
    out = tmp_path / "out"
    mesh = {
        "teacher": {"tp": 2, "cp": 2, "hosts": 2},
        "student": {"dp": 2, "cp": 2, "hosts": 2},
        "placement": placement,
    }
    cfg = tiny_config(
        str(corpus_dir), str(out), mesh=mesh, pipeline={"mode": "ray"},
        teacher={"checkpoint": str(tiny_run.out / "teacher")},
    )  # fmt: skip
    assert _run(tmp_path, cfg, record) == 0
    runs = [_train(o) for o in (tiny_run.out, out)]
    assert sorted(runs[0]) == sorted(runs[1]) == [2, 4, 6]
    for step, expected in runs[0].items():
        for key in KEYS:
            assert runs[1][step][key] == pytest.approx(expected[key], rel=0, abs=1e-6), key
    final, want = _summary(out)["final_eval"], _summary(tiny_run.out)["final_eval"]
    for key in ("teacher_loss", "student_loss", "kl", "student_bpb", "teacher_bpb", *SAMPLE_KEYS):
        # means over every held-out token in the layout's order: 1e-6 relative at 5 to 8
        assert final[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
    info = infos[-1]  # a colocated group's: the student's layout, the teacher's beside it
    layout, processes = info.get("teacher_layout", info["layout"]), info["processes"]
    assert layout["shape"] == {"dp": 1, "ep": 1, "cp": 2, "tp": 2}
    ids = [d["id"] for d in layout["devices"]]  # cp chunk c is process c's devices
    assert [p["local_devices"] for p in processes] == [ids[:2], ids[2:]]
    assert runs[1][6]["bytes_per_token"] == (8 * 8 if placement == "split" else 0)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_cp_across_tokenizers_in_groups(ray_cluster, cross_cp_1, tmp_path, placement):  # noqa: F811
    """Across tokenizers, the roles' cp = 2 in groups of 2 processes (the teacher's cp
    across them, so each teacher process gathers the outputs at its half of the student's
    positions, the teacher's blocks passed around a ring across the processes): the
    losses, the aligned share and the evaluations of the local cp = 1 run to 1e-6."""
    cp_1, tree = cross_cp_1
    out = tmp_path / "out"
    cfg = with_cp(tree, out, pipeline={"mode": "ray"}, mesh={"placement": placement})
    for role in ("teacher", "student"):
        cfg["mesh"][role]["hosts"] = 2
    assert _run(tmp_path, cfg) == 0
    assert_same_as_cp_1(out, cp_1)
