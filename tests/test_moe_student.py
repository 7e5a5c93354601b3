"""Mixture-of-experts students: the training step on dp x fsdp (experts split over fsdp and
dispatched by all-to-all, or gathered when fsdp does not divide them; a shared expert
beside them) equals the single device's, the load-balancing loss included; that loss
equals transformers' `load_balancing_loss_func` and a Qwen3-MoE's own `aux_loss`; a
student is dense unless it says experts; a student read from a transformers Qwen3-MoE
(vocabulary padded past the tokenizer's) distils, records its routing and exports as
Qwen3MoeForCausalLM with the same log-probs; Mixtral, Qwen2-MoE (its shared expert
included) and OLMoE export too."""

import functools
import json

import numpy as np
import optax
import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from distill.config import DistillLossConfig, ModelConfig, OptimConfig  # noqa: E402
from distill.config.load import config_from_dict  # noqa: E402
from distill.errors import DistillError  # noqa: E402
from distill.mesh import CP, DP, FSDP  # noqa: E402
from distill.models import counts, hf, model, moe  # noqa: E402
from pipelines.commands.cli import main  # noqa: E402
from student import eval_programs, export, optim, routing, train  # noqa: E402
from teacher.weights import student_init_params  # noqa: E402
from tests.conftest import read_train, tiny_config  # noqa: E402
from tests.test_families import _save as save_family  # noqa: E402
from tests.test_fsdp import _batch, _mesh, _teacher  # noqa: E402
from tests.test_hf import _cfg_tree, _hf_logits, _save_llama  # noqa: E402
from tests.test_moe import FAMILIES  # noqa: E402

LIVE = 259  # the byte tokenizer's ids; the students' vocabularies are padded past them


def _moe_cfg(n_experts):
    return ModelConfig(
        vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48,
        n_experts=n_experts, experts_per_token=2, d_ff_expert=16, dense_layers=(1,),
        d_ff_shared=24,
    )  # fmt: skip


@functools.cache
def _step(n_experts, dp, fsdp, cp=1):
    """(params after one SGD step, its metrics) of the MoE student on a dp x fsdp (x cp)
    mesh, with the load-balancing loss on and a row half padding (SGD: equal parameters
    after the step are equal gradients)."""
    cfg, mesh, tx = _moe_cfg(n_experts), _mesh(dp, fsdp, cp), optax.sgd(0.5)
    step = train.make_train_step(
        cfg, tx, mesh, loss_cfg=DistillLossConfig(alpha=0.7, moe_aux_loss=0.1),
        lr_schedule=optim.schedule(OptimConfig(), 10),
    )  # fmt: skip
    state = train.init_state(cfg, tx, 0, mesh, jax.device_get(model.init_params(cfg, 0)))
    batch = _batch(8)
    batch.segment_ids[1, 8:] = 0  # padding: not balanced
    state, metrics = step(state, batch, _teacher(8))
    return state.params, jax.device_get(metrics)


@pytest.mark.parametrize(
    "n_experts, dp, fsdp, split",
    [
        (4, 2, 2, True),
        pytest.param(4, 1, 4, True, marks=pytest.mark.slow),  # one expert a device
        pytest.param(6, 2, 2, True, marks=pytest.mark.slow),  # three experts a device
        (6, 1, 4, False),
    ],
)
def test_sharded_step_equals_one_device(n_experts, dp, fsdp, split):
    """Experts split over fsdp (tokens dispatched to them) when fsdp divides E, else
    gathered like any weight: either way the single device's losses and gradients."""
    want_params, want = _step(n_experts, 1, 1)
    params, got = _step(n_experts, dp, fsdp)
    assert 1.5 < want["moe_aux_loss"] < 2.5  # k = 2 for perfectly balanced routing
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=k)
    assert want["student_expert_counts"].sum() == (8 * 16 - 8) * 2 * 2  # real x k x MoE layers
    spec = params["layers"]["we_gate"].sharding.spec
    assert (spec == P(None, FSDP, None, None)) == split
    for a, b in zip(jax.tree.leaves(want_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "n_experts, fsdp, split", [(4, 2, True), pytest.param(6, 2, False, marks=pytest.mark.slow)]
)
def test_a_cp_step_equals_one_device(n_experts, fsdp, split):
    """On cp = 2 (each row's positions over two devices): each device routes its pieces'
    tokens, to experts split over fsdp x cp when it divides E, else gathered; the
    load-balancing loss is normalised by the whole batch's routing and tokens, so the
    single device's losses, routing counts and gradients."""
    rows = routing.Routing(_moe_cfg(n_experts), _mesh(1, fsdp, 2)).layout.rows
    assert rows == (DP, FSDP, CP)  # each device routes its own pieces, none twice
    want_params, want = _step(n_experts, 1, 1)
    params, got = _step(n_experts, 1, fsdp, 2)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=k)
    spec = params["layers"]["we_gate"].sharding.spec
    assert (spec == P(None, (FSDP, CP), None, None)) == split
    for a, b in zip(jax.tree.leaves(want_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-5)


def test_sharded_evaluation_equals_one_device():
    """The evaluation runs the same per-device layer: the single device's metrics."""
    params = jax.device_get(_step(4, 1, 1)[0])
    logits = np.random.default_rng(5).normal(size=(8, 16, 64)).astype(np.float32)
    got = [
        jax.device_get(
            eval_programs.make_eval_fn(_moe_cfg(4), _mesh(dp, fsdp))(params, _batch(8), logits)
        )
        for dp, fsdp in ((1, 1), (2, 2))
    ]
    for k in got[0]:
        np.testing.assert_allclose(got[1][k], got[0][k], rtol=2e-5, atol=2e-6, err_msg=k)


def test_balance_loss_is_transformers_on_the_same_logits():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(0)
    n_layers, e, k = 3, 8, 2
    logits = rng.normal(size=(n_layers, 2 * 10, e)).astype(np.float32) * 2
    mask = np.ones((2, 10), np.float32)
    mask[1, 6:] = 0
    want = load_balancing_loss_func(
        tuple(torch.tensor(x) for x in logits), e, k, torch.tensor(mask)
    ).item()
    sums = [0.0, 0.0]
    for layer in logits:  # the router on identity "hidden states" gives the logits back
        router, cfg = {"router": jnp.eye(e)}, ModelConfig(n_experts=e, experts_per_token=k)
        _, ids = moe.route(jnp.asarray(layer), router, cfg)
        counts, probs = moe._balance(jnp.asarray(layer), router, cfg, ids, jnp.asarray(mask))
        sums = [sums[0] + counts, sums[1] + probs]
    got = moe.balance_loss(tuple(sums), mask.sum(), n_layers, e)
    assert float(got) == pytest.approx(want, rel=1e-5)


@pytest.fixture(scope="module")
def qwen3_moe_student(tmp_path_factory):
    """(directory of a transformers Qwen3-MoE of vocabulary 288, the model reloaded)."""
    path = tmp_path_factory.mktemp("qwen3_moe_student")
    common = dict(
        vocab_size=288, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    name = "qwen3_moe_dense_layer_norm_topk"
    return path, save_family(path, name, {name: FAMILIES[name]}, common)


def test_aux_loss_is_the_models_own(qwen3_moe_student):
    """Our forward's load-balancing loss on a padded batch is transformers' `aux_loss`."""
    path, ref = qwen3_moe_student
    cfg = hf.read_model_config(path)
    params = student_init_params_of(path, cfg)
    tokens = np.random.default_rng(2).integers(0, LIVE, (2, 12)).astype(np.int32)
    seg = np.ones_like(tokens)
    seg[1, 7:] = 0  # right padding: the real tokens never see it
    pos = np.tile(np.arange(12, dtype=np.int32), (2, 1))
    with torch.no_grad():
        out = ref(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(seg),
            output_router_logits=True,
        )
    _, _, stats = model.apply_hidden(
        cfg, params, tokens, seg, pos, moe_opts={"token_mask": seg != 0}, with_stats=True
    )
    balance = jax.tree.map(lambda x: jnp.sum(x, axis=0), stats.balance)
    got = moe.balance_loss(balance, float(seg.sum()), sum(cfg.moe_layers()), cfg.n_experts)
    assert float(got) == pytest.approx(out.aux_loss.item(), rel=1e-5)


def student_init_params_of(path, cfg):
    from teacher.hf import read_hf_layers

    return read_hf_layers(path, cfg, list(range(cfg.n_layers)))


def test_a_student_is_dense_unless_it_says_experts():
    moe_teacher = {"n_experts": 4, "experts_per_token": 2, "d_ff_expert": 16, "family": "qwen3_moe"}
    tree = tiny_config("corpus", "out")
    tree["teacher"]["model"].update(moe_teacher, qk_norm=True)
    dense = config_from_dict(tree).student_model()
    assert (dense.n_experts, dense.family, dense.d_ff_expert) == (0, "qwen3", None)
    tree["student"]["model"]["n_experts"] = 4
    routed = config_from_dict(tree).student_model()
    assert (routed.n_experts, routed.f_expert, routed.family) == (4, 16, "qwen3_moe")
    shared = dict(tree, teacher=dict(tree["teacher"], model=dict(tree["teacher"]["model"])))
    shared["teacher"]["model"].update(family="qwen2_moe", qk_norm=False, d_ff_shared=8)
    assert config_from_dict(shared).student_model().f_shared == 8  # it says experts
    shared["student"] = {"model": {}}
    dense = config_from_dict(shared).student_model()
    assert (dense.family, dense.d_ff_shared, dense.f_shared) == ("qwen2", 0, 0)
    tree["student"]["model"] = {"n_layers": 1}
    tree["student"]["init"] = "from_teacher"
    assert config_from_dict(tree).student_model().n_experts == 4  # the teacher's layers
    tree["student"]["model"]["n_experts"] = 0
    with pytest.raises(DistillError, match=r"student.model.n_experts: 0 differs .*from_teacher"):
        config_from_dict(tree)
    tree["teacher"]["model"].update(n_layers=3, dense_layers=[1])  # kept: layers 0 and 2
    tree["student"]["model"] = {"n_layers": 2}  # the kept layers' dense ones: none
    cfg = config_from_dict(tree)
    assert cfg.init_layers() == [0, 2] and cfg.student_model().dense_layers == ()
    tree["student"]["init_layers"] = [1, 2]  # the dense layer kept, as the student's first
    assert config_from_dict(tree).student_model().dense_layers == (0,)
    tree["student"]["model"]["dense_layers"] = [1]
    with pytest.raises(DistillError, match=r"dense_layers: \[1\] are not .* dense ones \[0\]"):
        config_from_dict(tree)
    del tree["student"]["init_layers"]
    tree["student"] = {"model": {"d_model": 16}}
    # a random teacher, worse than the student: without the gate every step distils
    tree["distill"] = {"moe_aux_loss": 0.01, "alpha_gate": False}
    with pytest.raises(DistillError, match=r"distill.moe_aux_loss: 0.01 needs a mixture"):
        config_from_dict(tree)


def _moe_student_tree(corpus_dir, out, teacher_dir, student_dir):
    tree = _cfg_tree(corpus_dir, out, teacher_dir)
    tree["student"] = {"checkpoint": str(student_dir)}
    tree["mesh"]["student"] = {"dp": 1, "fsdp": 2}
    # a random teacher, worse than the student: without the gate every step distils
    tree["distill"] = {"moe_aux_loss": 0.01, "alpha_gate": False}
    tree["train"].update(steps=2, eval_every=2, checkpoint_every=2, log_every=1)
    return tree


def test_an_moe_student_distils_records_routing_and_exports(
    qwen3_moe_student, corpus_dir, tmp_path, capsys
):
    """From a dense Llama teacher: the student's log-probs start as transformers'; the run
    records moe_aux_loss and the student's expert load, and colocated (both roles on two
    devices) the same losses and load; the export loads as
    Qwen3MoeForCausalLM with the trained student's log-probs over the tokenizer's ids."""
    student_dir, ref = qwen3_moe_student
    teacher_dir = tmp_path / "teacher"
    _save_llama(teacher_dir, vocab_size=320, num_attention_heads=4, num_key_value_heads=2)
    out = tmp_path / "out"
    cfg = config_from_dict(_moe_student_tree(corpus_dir, out, teacher_dir, student_dir))
    scfg = cfg.student_model()
    assert (scfg.n_experts, scfg.vocab_size, scfg.dense_layers) == (4, 288, (1,))
    tokens = np.random.default_rng(3).integers(0, LIVE, (2, 12)).astype(np.int32)
    pos = np.tile(np.arange(12, dtype=np.int32), (2, 1))
    ours = model.apply(scfg, student_init_params(cfg), tokens, np.ones_like(tokens), pos)
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(ref, tokens), atol=2e-4, rtol=1e-4)

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_moe_student_tree(corpus_dir, out, teacher_dir, student_dir)))
    assert main(["run", str(path)]) == 0
    records = read_train(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 1.0 < r["moe_aux_loss"] < 4.0 and len(r["student_expert_load"]) == 4
        assert sum(r["student_expert_load"]) == pytest.approx(1.0)
        assert r["student_expert_load_max_mean"] >= 1.0
    both = tmp_path / "colocated"  # the student's fsdp=2 on the teacher's two devices
    tree = _moe_student_tree(corpus_dir, both, teacher_dir, student_dir)
    tree["mesh"]["placement"] = "colocated"
    path.write_text(yaml.safe_dump(tree))
    assert main(["run", str(path)]) == 0
    for a, b in zip(records, read_train(both), strict=True):
        for key in ("loss", "kd_loss", "ce_loss", "moe_aux_loss"):
            assert abs(a[key] - b[key]) <= 1e-6, (a["step"], key)
        assert np.allclose(a["student_expert_load"], b["student_expert_load"], rtol=0, atol=1e-6)
    capsys.readouterr()
    assert main(["export", str(out)]) == 0
    exported = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["export"]
    got = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(got).__name__ == "Qwen3MoeForCausalLM"
    params = _latest_params(out)
    trained = np.asarray(model.apply(scfg, params, tokens, np.ones_like(tokens), pos))[..., :LIVE]
    want = torch.log_softmax(torch.tensor(trained), -1).numpy()
    theirs = torch.log_softmax(torch.tensor(_hf_logits(got, tokens)), -1).numpy()
    np.testing.assert_allclose(theirs, want, atol=1e-4)


def _latest_params(out):
    from distill.checkpoint import Checkpointer

    cfg = config_from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps)
    ckpt = Checkpointer(str(out / "checkpoints"))
    target = train.saved(train.abstract_state(cfg.student_model(), tx, _mesh(1, 1)))
    state, _, _ = ckpt.restore(target)
    ckpt.close()
    return state.params


@pytest.mark.parametrize(
    "family, keys",
    [
        ("mixtral", dict(norm_topk_prob=True)),
        ("qwen2_moe", dict(qkv_bias=True, d_ff_shared=24, dense_layers=(1,))),
        ("olmoe", dict(qk_norm=True, qk_norm_full=True, experts_per_token=3)),
    ],
)
def test_export_writes_what_transformers_loads_as_the_family(tmp_path, family, keys):
    """A random MoE student of the family: transformers' class and log-probs (the padded
    vocabulary trimmed to the tokenizer's ids)."""
    cfg = ModelConfig(
        vocab_size=288, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
        n_experts=4, family=family, **keys,
    )  # fmt: skip
    params = jax.device_get(model.init_params(cfg, 1))
    out = export.write_hf(tmp_path / family, cfg, params, max_position_embeddings=64)
    got = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(got).__name__ == export.hf_config.ARCHITECTURES[family]
    tokens = np.random.default_rng(4).integers(0, LIVE, (2, 10)).astype(np.int32)
    pos = np.tile(np.arange(10, dtype=np.int32), (2, 1))
    ours = np.asarray(model.apply(cfg, params, tokens, np.ones_like(tokens), pos))[..., :LIVE]
    want = torch.log_softmax(torch.tensor(ours), -1).numpy()
    theirs = torch.log_softmax(torch.tensor(_hf_logits(got, tokens)), -1).numpy()
    np.testing.assert_allclose(theirs, want, atol=1e-4)


def test_plan_counts_an_moe_students_active_parameters():
    from pipelines import plan

    tree = tiny_config("corpus", "out")
    tree["student"]["model"].update(n_experts=4, experts_per_token=2, d_ff_expert=8)
    cfg = config_from_dict(tree)
    s = plan.plan(cfg, _Layout())["student"]
    idle = 1 * 2 * 3 * 16 * 8  # layers x idle experts x (gate, up, down) x D x F
    assert s["params"] - s["active_params"] == idle
    assert s["active_params"] == counts.active_param_count(cfg.student_model())


class _Layout:
    def layout(self):
        return {}
