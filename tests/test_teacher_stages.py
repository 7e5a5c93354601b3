"""Pipeline-parallel teacher stages (`mesh.teacher.pp`, `teacher.stages`): the staged
forward gives the unstaged one's outputs (float32, within 1e-6) for a dense, a windowed
(Gemma-3-like: sliding and full layers, a local RoPE base, post-norms, soft-caps) and a
mixture-of-experts family (dense and MoE layers mixed, experts over ep, its expert load),
top-k and dense, with tp (and dp, ep) inside the stages; a staged `distill run` gives the
unstaged run's losses; validation refuses what is not built in one line; `distill plan`
reports the stages."""

import json
import logging

import jax
import numpy as np
import pytest

from distill.config import ModelConfig
from distill.config.load import config_from_dict
from distill.errors import DistillError
from distill.mesh import devices_needed, teacher_mesh
from distill.models import model
from pipelines import placement, plan
from pipelines.commands.cli import main
from teacher.forward import make_forward
from teacher.sharding import shard_params
from teacher.stages import bubble, check_stages
from tests.conftest import tiny_config, train_by_step, write_config
from tests.test_model import _batch

SMALL = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48)
FAMILIES = {
    "dense": ModelConfig(**SMALL),
    "windowed": ModelConfig(
        **SMALL,
        sliding_window=5,
        layer_types=("sliding", "sliding", "sliding", "full"),  # Gemma 3: 5 local, 1 global
        rope_local_theta=10000.0,
        rope_theta=1e6,
        post_norms=True,
        norm_offset=1.0,
        embed_scale=True,
        activation="gelu_tanh",
        final_softcap=30.0,
    ),
    "moe": ModelConfig(
        **SMALL, n_experts=4, experts_per_token=2, d_ff_expert=16, dense_layers=(1,)
    ),
    # SmolLM3: a NoPE layer in the second stage only: each stage scans its own RoPE tables
    "nope": ModelConfig(**SMALL, rope_layers=(True, True, False, True), tie_embeddings=True),
}


def _outputs(cfg, batch, pp, dp, ep, tp, **kw):
    mesh = teacher_mesh(jax.devices()[: pp * dp * ep * tp], dp, tp, ep, pp)
    params = shard_params(model.init_params(cfg, 1), cfg, mesh)
    return make_forward(cfg, mesh, **kw)(params, batch)


CASES = [  # family, (pp, dp, ep, tp), rows, mode; the stages' outputs against pp=1's
    ("dense", (4, 1, 1, 2), 8, "topk"),
    ("windowed", (2, 2, 1, 2), 8, "dense"),
    ("moe", (2, 1, 2, 2), 8, "topk"),
    ("dense", (2, 1, 1, 1), 3, "dense"),  # rows that do not split over the stages
    ("windowed", (2, 1, 1, 2), 4, "target_logprobs"),  # on-policy scoring
    ("nope", (2, 1, 1, 2), 8, "topk"),
    *[
        pytest.param(*case, marks=pytest.mark.slow)
        for case in [
            ("dense", (4, 1, 1, 2), 8, "dense"),
            ("dense", (2, 2, 1, 2), 8, "topk"),
            ("windowed", (4, 1, 1, 2), 8, "topk"),
            ("windowed", (2, 2, 1, 2), 8, "topk"),
            ("moe", (2, 1, 2, 2), 6, "dense"),
            ("moe", (4, 1, 1, 2), 8, "dense"),
        ]
    ],
]


@pytest.mark.parametrize("family, axes, rows, mode", CASES)
def test_stages_give_the_unstaged_outputs(family, axes, rows, mode):
    """Microbatches of one row (m = the dp group's rows) stream through the stages; the
    outputs leave with their rows split over every device (pp inside dp, over tp) when they
    divide, else replicated, and equal the pp=1 mesh's of the same dp x ep x tp."""
    cfg, (pp, dp, ep, tp) = FAMILIES[family], axes
    kw = {"mode": mode, "top_k": 5 if mode == "topk" else None, "microbatch": 1}
    if cfg.n_experts and mode == "topk":
        kw["expert_load"] = True
    batch = _batch(b=rows, s=12)
    want = _outputs(cfg, batch, 1, dp, ep, tp, **kw)
    got = _outputs(cfg, batch, pp, dp, ep, tp, **kw)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=0)
    out = jax.tree.leaves(got)[0]
    split = rows % (pp * dp * ep * tp) == 0
    assert ("pp" in str(out.sharding.spec)) == split
    if kw.get("expert_load"):
        load = got[1]
        assert int(load.tokens.sum()) == rows * 12 * 2 * 3  # tokens x k x MoE layers


@pytest.mark.parametrize("dense_layers", [(0,), ()])
def test_stages_that_do_not_divide_the_layers_pad_them_with_zero_layers(dense_layers):
    """3 layers over pp=2 (as DeepSeek-V3's 61): the stack is padded with one zero layer,
    which passes its input through, so the outputs and the expert load are the unstaged
    mesh's (a dense first layer as DeepSeek's first_k_dense_replace, or every layer MoE:
    the padding layer's routing is not counted)."""
    from teacher.stages import stacked_layers

    cfg = ModelConfig(
        **{**SMALL, "n_layers": 3}, n_experts=4, experts_per_token=2, d_ff_expert=16,
        dense_layers=dense_layers,
    )  # fmt: skip
    assert stacked_layers(3, 2) == 4
    kw = {"mode": "topk", "top_k": 5, "microbatch": 1, "expert_load": True}
    batch = _batch(b=4, s=12)
    want = _outputs(cfg, batch, 1, 1, 2, 1, **kw)
    got = _outputs(cfg, batch, 2, 1, 2, 1, **kw)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=0)
    moe_layers = 3 - len(dense_layers)
    assert int(got[1].tokens.sum()) == 4 * 12 * 2 * moe_layers


def _tree(corpus_dir, tmp_path, **teacher_mesh_):
    tree = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    tree["mesh"]["teacher"].update(teacher_mesh_)
    return tree


def test_devices_and_refusals(corpus_dir, tmp_path, caplog):
    """The stages multiply the inference mesh; more stages than the layers fill are refused
    in one line naming the field (ray mode is not: its stages are a teacher group's
    processes, tests/test_multihost.py); one microbatch (stages that cannot overlap) is a
    logged warning; under auto placement every candidate keeps the stages."""
    cfg = config_from_dict(_tree(corpus_dir, tmp_path, pp=2))
    assert devices_needed(cfg) == 2 * 2 + 2  # pp x tp + the student's dp
    with caplog.at_level(logging.WARNING, logger="distill"):
        check_stages(cfg)
    assert "mesh.teacher.pp=2 with one teacher microbatch" in caplog.text
    bad = [
        ({"pp": 4}, {}, "^mesh.teacher.pp: 4 stages of 1 layers leave the last stage none"),
    ]
    ray = _tree(corpus_dir, tmp_path, pp=2, hosts=2)
    ray["pipeline"] = {"mode": "ray"}
    check_stages(config_from_dict(ray))
    assert "each stage spans" not in caplog.text
    ray["mesh"]["teacher"].update(hosts=4, tp=4)  # 2 stages over 4 hosts: tp crosses hosts
    with caplog.at_level(logging.WARNING, logger="distill"):
        check_stages(config_from_dict(ray))
    assert "mesh.teacher.hosts=4 with mesh.teacher.pp=2: each stage spans 2 hosts" in caplog.text
    auto = _tree(corpus_dir, tmp_path, pp=2)
    auto["mesh"] = {"placement": "auto", "teacher": {"pp": 2}}
    layouts = placement.candidates(config_from_dict(auto), 8)
    assert layouts and all(x.fixed == (2, 1, 1) and x.sizes()[0] % 2 == 0 for x in layouts)
    for mesh, sections, message in bad:
        tree = _tree(corpus_dir, tmp_path, **mesh)
        for section, values in sections.items():
            tree.setdefault(section, {}).update(values)
        with pytest.raises(DistillError, match=message):
            check_stages(config_from_dict(tree))


def test_validate_and_plan_refuse_in_one_line(corpus_dir, tmp_path, capsys):
    """`distill validate` refuses more stages than the layers fill."""
    path = write_config(tmp_path, _tree(corpus_dir, tmp_path, pp=4))
    assert main(["validate", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("mesh.teacher.pp: 4 stages of 1 layers leave the last stage none "
                            "of teacher.model.n_layers=2; use fewer stages")  # fmt: skip


def test_plan_figures_of_the_stages(corpus_dir, tmp_path):
    """Each stage holds its share of the layers (the embedding and head on every stage);
    the bubble and the bytes between stages follow the microbatches."""
    one = config_from_dict(_tree(corpus_dir, tmp_path))
    tree = _tree(corpus_dir, tmp_path, pp=2)
    tree["teacher"]["microbatch"] = 1
    two = config_from_dict(tree)
    a, b = plan.teacher_figures(one), plan.teacher_figures(two)
    layers, per = plan.layer_params(one), 4  # float32 on CPU (teacher.dtype auto -> 4 B)
    assert a["weight_bytes_per_device"] - b["weight_bytes_per_device"] == layers * per // 2 // 2
    assert "stages" not in a
    assert (b["stages"], b["layers_per_stage"], b["microbatches"]) == (2, 1, 4)
    assert b["bubble"] == bubble(2, 4) == 1 / 5
    rows, seq, d = 1, one.train.seq_len, one.teacher.model.d_model
    assert b["stage_bytes_per_step"] == rows * seq * d * per * (2 - 1) * 4


@pytest.mark.parametrize("placement", ["split", pytest.param("colocated", marks=pytest.mark.slow)])
def test_a_staged_run_gives_the_runs_losses(tiny_run, tmp_path, placement):
    """The tiny run again with its teacher in two stages of one layer (tp=2 inside each),
    microbatches of one row streaming through them: the same losses (the student beside
    the stages, or colocated on the first stage's devices)."""
    tree = json.loads(json.dumps(tiny_run.tree))
    out = tmp_path / "out"
    tree["run"]["output_dir"] = str(out)
    tree["mesh"]["teacher"]["pp"] = 2
    tree["mesh"]["placement"] = placement
    tree["teacher"].update(checkpoint=str(tiny_run.out / "teacher"), pretrain_steps=0)
    tree["teacher"]["microbatch"] = 1
    assert main(["run", write_config(tmp_path, tree)]) == 0
    want, got = train_by_step(tiny_run.out), train_by_step(out)
    assert sorted(got) == sorted(want) == [2, 4, 6]
    for step, r in want.items():
        for key in ("loss", "kd_loss", "ce_loss"):
            assert abs(got[step][key] - r[key]) <= 1e-6, (step, key)


HF_CASES = [  # (family, its test module, pp, ep, tp): 4 Gemma 3 layers, 3 Qwen3-MoE layers
    ("gemma3_one_kv_head_local_rope", "test_families", 2, 1, 2),
    ("qwen3_moe_dense_layer_norm_topk", "test_moe", 3, 1, 2),
    # each expert's tensor written only into the ep shard of the stage that holds it
    ("qwen3_moe_dense_layer_norm_topk", "test_moe", 2, 2, 2),
]


@pytest.mark.parametrize("name, module, pp, ep, tp", HF_CASES)
def test_hf_teachers_load_into_their_stages(tmp_path, name, module, pp, ep, tp):
    """A transformers-built checkpoint read tensor by tensor into the staged layout (each
    stage's devices holding its own layers) gives the unstaged mesh's outputs. (With these
    O(1) weights, logits near 15, microbatches of one row differ by float32 rounding, about
    3e-6 absolute: XLA compiles a one-row matmul in the staged loop differently.)"""
    pytest.importorskip("transformers")
    import importlib

    from distill.models import hf
    from teacher.hf import load_hf_teacher
    from tests.test_families import _save
    from tests.test_hf import _batch as hf_batch

    tests = importlib.import_module(f"tests.{module}")
    _save(tmp_path, name, tests.FAMILIES, tests.COMMON)
    cfg = hf.read_model_config(tmp_path)
    batch = hf_batch(cfg.vocab_size, b=4, s=12)
    outs = []
    for stages in (1, pp):
        mesh = teacher_mesh(jax.devices()[: stages * ep * tp], 1, tp, ep, stages)
        params = load_hf_teacher(tmp_path, cfg, mesh)
        wq = params["layers"]["wq"]
        assert wq.sharding.spec[0] == ("pp" if stages > 1 else None)
        shard = wq.addressable_shards[0].data
        assert shard.shape[0] == -(-cfg.n_layers // stages)  # a stage holds its layers only
        fwd = make_forward(cfg, mesh, mode="topk", top_k=4, microbatch=2)
        outs.append(fwd(params, batch))
    got, want = outs[1], outs[0]
    np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(want.ids))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-6)


@pytest.mark.slow
def test_a_staged_cache_gives_the_runs_losses(tiny_run, tmp_path):
    """`distill cache-teacher` with the teacher in two stages, then a run from that cache:
    the online run's losses."""
    tree = json.loads(json.dumps(tiny_run.tree))
    tree["run"]["output_dir"] = str(tmp_path / "out")
    tree["mesh"]["teacher"]["pp"] = 2
    tree["teacher"].update(
        checkpoint=str(tiny_run.out / "teacher"), pretrain_steps=0, microbatch=1,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    assert main(["cache-teacher", write_config(tmp_path, tree)]) == 0
    tree["teacher"]["source"] = "cache"
    assert main(["run", write_config(tmp_path, tree)]) == 0
    want, got = train_by_step(tiny_run.out), train_by_step(tmp_path / "out")
    assert sorted(got) == sorted(want) == [2, 4, 6]
    for step, r in want.items():
        assert got[step]["loss"] == pytest.approx(r["loss"], rel=1e-5), step


def test_a_stage_reads_only_its_own_layers():
    """A layer's tensor is read by the devices of the stage that holds it: the callback of
    another stage's slot gives zeros of its block's shape without reading the tensor (bar
    one element, for its dtype), so in a group of processes a stage's process reads only
    its own layers' tensors."""
    import numpy as np

    from teacher.hf import _in_stage

    tensor, reads = np.arange(4 * 6, dtype=np.float32).reshape(1, 4, 6), []

    def read(index):
        reads.append(index)
        return tensor[index]

    whole = (2, 1, 4, 6)  # a slot per stage, one layer of [4, 6]
    callback = _in_stage(read, 1, whole)
    assert [r[1:] for r in reads] == [(slice(0, 1),) * 2]  # the dtype's one element
    block = (slice(None), slice(0, 2), slice(None))
    other = callback((slice(0, 1), *block))
    assert other.shape == (1, 1, 2, 6) and other.dtype == np.float32 and not other.any()
    assert len(reads) == 1
    np.testing.assert_array_equal(callback((slice(1, 2), *block))[0], tensor[block])
    assert reads[-1] == block
