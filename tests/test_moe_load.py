"""An MoE teacher's expert load: the training-time forward's routing counts over a
dp x ep x tp mesh equal the single-device model's; the loop's logged windows take exactly
their steps' counts; a distillation run from a tiny transformers-built Qwen3-MoE records
the load (checked against the single-device model on the same batches) and, with a
capacity factor, the dropped share."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402

from distill.config.load import config_from_dict  # noqa: E402
from distill.data.loader import load_corpus  # noqa: E402
from distill.mesh import teacher_mesh  # noqa: E402
from distill.models import hf, model  # noqa: E402
from distill.models.moe import ExpertLoad  # noqa: E402
from distill.observability.expert_load import LoadWindow, load_figures  # noqa: E402
from pipelines import hooks as h  # noqa: E402
from pipelines.commands.run import run  # noqa: E402
from pipelines.loop import Loop, LoopSpec  # noqa: E402
from pipelines.sources import QueueSource  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.hf import load_hf_teacher, read_hf_layers  # noqa: E402
from tests import test_moe as moe_tests  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from tests.test_families import _save as save_family  # noqa: E402
from tests.test_hf import _batch  # noqa: E402
from tests.test_loop import Executor  # noqa: E402

QWEN3_MOE = "qwen3_moe_dense_layer_norm_topk"  # layers 0 and 2 MoE, layer 1 dense
COMMON = {**moe_tests.COMMON, "vocab_size": 260}  # the byte tokenizer's: runs on the corpus


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """(directory of a tiny transformers Qwen3-MoE, its model config, its single-device
    parameters)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    save_family(path, QWEN3_MOE, moe_tests.FAMILIES, COMMON)
    cfg = hf.read_model_config(path)
    return path, cfg, read_hf_layers(path, cfg, list(range(cfg.n_layers)))


def _single_device_counts(cfg, params, batch, capacity_factor=None) -> ExpertLoad:
    """The routing counts of `batch` through the single-device model, summed over layers."""
    moe_opts = {"ep_axis": None, "capacity_factor": capacity_factor}
    _, _, stats = model.apply_hidden(
        cfg, params, batch.tokens, batch.segment_ids, batch.positions, moe_opts=moe_opts,
        with_stats=True,
    )  # fmt: skip
    return ExpertLoad(np.asarray(stats.tokens).sum(0), int(np.asarray(stats.dropped).sum()))


@pytest.mark.parametrize("dp, ep, tp, micro", [(2, 2, 2, 1), (1, 2, 1, None)])
def test_forward_counts_equal_the_single_device_model(qwen3_moe, dp, ep, tp, micro):
    """Summed over dp and ep (not tp), over layers and microbatches: the single-device
    model's counts, T * k per MoE layer; the output itself is the plain forward's."""
    path, cfg, single = qwen3_moe
    mesh = teacher_mesh(jax.devices()[: dp * ep * tp], dp, tp, ep)
    params = load_hf_teacher(path, cfg, mesh)
    batch = _batch(cfg.vocab_size, b=8, s=12)
    kw = dict(mode="topk", top_k=4, microbatch=micro)
    out, load = make_forward(cfg, mesh, expert_load=True, **kw)(params, batch)
    plain = make_forward(cfg, mesh, **kw)(params, batch)
    np.testing.assert_array_equal(np.asarray(out.ids), np.asarray(plain.ids))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(plain.logprobs), atol=1e-6)
    want = _single_device_counts(cfg, single, batch)
    np.testing.assert_array_equal(np.asarray(load.tokens), want.tokens)
    assert int(load.tokens.sum()) == 8 * 12 * 2 * 2  # tokens x k x MoE layers
    assert int(load.dropped) == 0 and load.tokens.sharding.is_fully_replicated


def test_forward_counts_the_dropped_assignments_per_device(qwen3_moe):
    """With a capacity factor each device (ep=2, one row per microbatch) drops what the
    single-device model drops on that row alone."""
    path, cfg, single = qwen3_moe
    mesh = teacher_mesh(jax.devices()[:2], 1, 1, 2)
    params = load_hf_teacher(path, cfg, mesh)
    batch = _batch(cfg.vocab_size, b=4, s=12)
    fwd = make_forward(
        cfg, mesh, mode="topk", top_k=4, microbatch=1, capacity_factor=0.5, expert_load=True
    )
    _, load = fwd(params, batch)
    rows = [jax.tree.map(lambda x, i=i: x[i : i + 1], batch) for i in range(4)]
    want = sum(_single_device_counts(cfg, single, r, 0.5).dropped for r in rows)
    assert int(load.dropped) == want > 0


def test_dense_teachers_refuse_expert_load():
    with pytest.raises(ValueError, match="expert_load needs a mixture of experts"):
        make_forward(hf.ModelConfig(), None, expert_load=True)


def test_window_figures():
    window = LoadWindow(dropping=True)
    window.add(ExpertLoad(np.array([3, 1, 0, 0]), np.int32(1)))
    window.add(ExpertLoad(np.array([1, 1, 2, 0]), np.int32(0)))
    window.add(ExpertLoad(np.array([0, 0, 0, 8]), np.int32(0)))
    got = window.figures(2)  # the oldest two
    assert got == {
        "expert_load": [0.5, 0.25, 0.25, 0.0],
        "expert_load_max_mean": 2.0,
        "expert_dropped": 1 / 8,
    }
    assert window.figures(5)["expert_load"] == [0.0, 0.0, 0.0, 1.0]
    assert window.figures(1) == {} and load_figures(np.zeros(4), 0) == {}
    assert "expert_dropped" not in load_figures(np.ones(4), None)


def test_logged_windows_take_their_own_steps():
    """Batch n (trained at step n) routes to expert n alone: each record's load is spread
    evenly over exactly the steps of its window (step - 2, step], with batches in flight
    past it, and again after the student is lost at step 8 and resumed from step 6."""

    class Data:
        def __init__(self):
            self.next = 0

        def __next__(self):
            self.next += 1
            return self.next

        def get_state(self):
            return {"next_index": self.next}

        def set_state(self, state):
            self.next = state["next_index"]

    def work(n):
        return n, f"out{n}", ExpertLoad(np.eye(16, dtype=np.int32)[n - 1], np.int32(0))

    records: list = []

    class Records:
        def on_metrics(self, loop, step, metrics, record):
            records.append(record)

    spec = LoopSpec(steps=12, prefetch=3, metrics_lag=2, log_every=2, tokens_per_step=1)
    hooks = [h.Checkpoints(3), Records()]
    executor = Executor([], lose_at=8)
    Loop(
        spec, QueueSource(Data, work), executor, hooks, record=lambda s, m, f: {"step": s, **f}
    ).run()
    assert executor.trained == list(range(1, 13))
    assert [r["step"] for r in records] == [2, 4, 8, 10, 12]  # 6 unread when 8 is lost
    for r in records:
        want = np.zeros(16)
        want[r["step"] - 2 : r["step"]] = 0.5
        assert r["expert_load"] == list(want) and r["expert_load_max_mean"] == 8.0, r


def _run_records(
    qwen3_moe, corpus_dir, out, placement="split", **teacher
) -> tuple[list[dict], list]:
    """(the training records of a 4-step run from the tiny Qwen3-MoE teacher on a dp x ep
    = 1 x 2 inference mesh into a random student, dense by default, the run's 4 batches)."""
    path, _, _ = qwen3_moe
    tree = tiny_config(
        str(corpus_dir),
        str(out),
        mesh={"teacher": {"ep": 2, "tp": 1}, "student": {"dp": 2}, "placement": placement},
        train={"steps": 4, "batch_size": 4, "seq_len": 32, "log_every": 2, "eval_every": 4},
    )
    tree["teacher"] = {"checkpoint": str(path), "top_k": 8, **teacher}
    # a random teacher, worse than the student: without the gate every step runs it
    tree.setdefault("distill", {})["alpha_gate"] = False
    cfg = config_from_dict(tree)
    assert run(cfg)["completed"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if "loss" in r and "eval" not in r and "event" not in r]
    it = load_corpus(cfg.data, cfg.train.seq_len).train_iterator(4, cfg.run.seed)
    return records, [next(it) for _ in range(4)]


@pytest.mark.parametrize("placement", ["split", "colocated"])
def test_a_run_from_an_moe_teacher_records_expert_load(qwen3_moe, corpus_dir, tmp_path, placement):
    """With a capacity factor, each ep device's two rows of a batch route and drop what the
    single-device model with that capacity routes and drops on them (a later layer's
    routing follows the earlier drops): each record's load and dropped share are those
    counts over its window's batches (the dropless counts are the forward tests'). The
    same with the student on the teacher's two devices (`mesh.placement: colocated`)."""
    _, cfg, single = qwen3_moe
    records, batches = _run_records(
        qwen3_moe, corpus_dir, tmp_path / "out", placement, moe_capacity_factor=0.5
    )
    assert [r["step"] for r in records] == [2, 4]
    for r, window in zip(records, (batches[:2], batches[2:]), strict=True):
        halves = [jax.tree.map(lambda x, i=i: x[i : i + 2], b) for b in window for i in (0, 2)]
        each = [_single_device_counts(cfg, single, h, 0.5) for h in halves]
        counts = sum(c.tokens for c in each)
        assert counts.sum() == 2 * 4 * 32 * 2 * 2  # batches x tokens x k x MoE layers
        assert r["expert_load"] == list(counts / counts.sum())
        assert r["expert_load_max_mean"] == pytest.approx(counts.max() / counts.mean())
        assert r["expert_dropped"] == sum(c.dropped for c in each) / counts.sum() > 0
