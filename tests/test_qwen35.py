"""Qwen3.5 text, dense (`qwen3_5_text`) and mixture (`qwen3_5_moe_text`), in the one model:
a tiny transformers model (three linear attention layers and a full one; the mixture's
every feed-forward 4 routed experts, top-2 renormalised, beside a shared expert with its
sigmoid gate; random O(1) weights) read by distill's loader gives transformers'
log-probabilities on the teacher's mesh at tp (the linear layers' heads split too) and ep
layouts and as the single-device student, on a packed batch (each document compared with
transformers run on it alone); it exports back in its family, decodes as its full forward
and generates transformers' greedy tokens."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distill.mesh import teacher_mesh  # noqa: E402
from distill.models import counts, decode, hf, model  # noqa: E402
from distill.types import Prompts  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.hf import load_hf_teacher, read_hf_layers  # noqa: E402
from tests.test_families import (  # noqa: E402
    _logprobs,
    _save,
    assert_documents_match,
    packed_batch,
    per_document_logprobs,
)

COMMON = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
)  # fmt: skip
MOE = dict(
    moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
    num_experts_per_tok=2,
)  # fmt: skip
FAMILIES = {
    "qwen3_5_text": ("Qwen3_5", "Qwen3_5TextConfig", {}),
    "qwen3_5_moe_text": ("Qwen3_5Moe", "Qwen3_5MoeTextConfig", MOE),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen35(request, tmp_path_factory):
    """(directory, transformers' model, its log-probs per document, the packed batch)."""
    path = tmp_path_factory.mktemp(request.param)
    common = COMMON  # the mixture's config.json has no dense width
    if request.param == "qwen3_5_moe_text":
        common = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
    ref = _save(path, request.param, FAMILIES, common)
    batch = packed_batch()
    return path, ref, per_document_logprobs(ref, batch), batch


def test_config_reads_layer_types_and_linear_shapes(qwen35):
    path, ref, _, _ = qwen35
    cfg = hf.read_model_config(path)
    assert cfg.types() == ("linear", "linear", "linear", "full")
    assert (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim) == (4, 8, 8)
    assert cfg.rope_dim == 4 and cfg.attn_output_gate and cfg.norm_offset == 1.0


def test_the_mixtures_experts_and_gated_shared_expert(qwen35):
    path, ref, _, _ = qwen35
    cfg = hf.read_model_config(path)
    assert counts.param_count(cfg) == sum(p.numel() for p in ref.parameters())
    if cfg.family == "qwen3_5_text":
        return
    assert (cfg.n_experts, cfg.experts_per_token, cfg.f_expert, cfg.f_shared) == (4, 2, 16, 24)
    assert cfg.shared_expert_gate and cfg.norm_topk_prob and all(cfg.moe_layers())
    assert cfg.d_ff == 2 * 16 + 24  # a dense student's width: what a token uses


@pytest.mark.parametrize("ep, tp", [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)])
def test_teacher_logprobs_match_transformers(qwen35, ep, tp):
    """At tp = 4 each shard holds one query/key head of the linear layers and its two value
    heads, and the full layer's 2 KV heads are replicated over pairs of shards."""
    path, _, want, batch = qwen35
    cfg = hf.read_model_config(path)
    if ep > 1 and not cfg.n_experts:
        pytest.skip("ep needs experts")
    mesh = teacher_mesh(jax.devices()[: ep * tp], 1, tp, ep)
    params = load_hf_teacher(path, cfg, mesh)
    got = make_forward(cfg, mesh, mode="logits")(params, batch)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4,
                           err_msg=f"ep={ep} tp={tp}")  # fmt: skip


def test_student_model_matches_transformers(qwen35):
    path, _, want, batch = qwen35
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    got = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg="student")


def test_export_round_trip(qwen35, tmp_path):
    """`student.export.write_hf` of the model read from the checkpoint: transformers loads
    it in its family (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM; in_proj_qkv and conv1d
    fused again) with the original's log-probs, and it reads back as the same config."""
    from student.export import write_hf

    path, ref, want, batch = qwen35
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    out = write_hf(tmp_path / "export", cfg, params, max_position_embeddings=64)
    got = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(got) is type(ref)
    logp = per_document_logprobs(got, batch)
    assert_documents_match(logp, want, batch, atol=2e-5, rtol=1e-5, err_msg="export")
    assert hf.read_model_config(out) == cfg


def test_a_bfloat16_export_in_shards_loads_in_transformers(qwen35, tmp_path):
    """As every student family's (`tests.test_families_students`): bfloat16 shards of at
    most 20 kB that transformers loads with the rounded model's log-probs and distill reads
    back bit for bit."""
    from tests.test_families_students import (
        test_a_bfloat16_export_in_shards_loads_in_transformers as bfloat16_shards,
    )

    path, ref, want, batch = qwen35
    bfloat16_shards((ref.config.model_type, path, ref, want, batch), tmp_path)


def _prompts(live, n_rows=3, p=6, seed=2):
    """Rows of p prompt tokens: one document; a last document of 2 tokens (shorter than the
    convolution's K - 1 = 3 cached inputs); left padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, live, (n_rows, p)).astype(np.int32)
    seg = np.array([[1] * 6, [1, 1, 1, 1, 2, 2], [0, 0, 1, 1, 1, 1]], np.int32)
    pos = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1], [0, 0, 0, 1, 2, 3]], np.int32)
    return Prompts(jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos))


def test_decode_with_the_linear_caches_matches_the_full_forward(qwen35):
    """Prefill then one token at a time: each step's logits are the full forward's at that
    position (the linear layers' state and convolution tails carried beside the full
    layer's keys and values), to 5e-4 on logits of about 5 (the mixture's experts sum in
    another order at one token than at the row's)."""
    path, _, _, batch = qwen35
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    tokens = batch.tokens[:1]
    seg, pos = jnp.ones_like(tokens), jnp.arange(tokens.shape[1])[None]
    full = np.asarray(model.apply(cfg, params, tokens, seg, pos))
    p, total = 7, tokens.shape[1]
    prompt = Prompts(tokens[:, :p], seg[:, :p], pos[:, :p])
    logits, cache = decode.prefill(cfg, params, prompt, total, dtype="float32")
    assert cache.k.shape[0] == 1 and cache.linear.state.shape[0] == 3  # per kind
    np.testing.assert_allclose(logits, full[:, p - 1], atol=5e-4, rtol=1e-4)
    step = jax.jit(functools.partial(decode.decode_step, cfg, dtype="float32"))
    for i in range(p, total):
        logits, cache = step(params, tokens[:, i], pos[:, i], jnp.int32(i), jnp.ones(1, bool),
                             cache)  # fmt: skip
        np.testing.assert_allclose(logits, full[:, i], atol=5e-4, rtol=1e-4, err_msg=str(i))


def test_greedy_generation_equals_transformers(qwen35):
    """`decode.generate` at temperature 0 gives transformers' `generate(do_sample=False)`
    token for token on each row's last document (two documents in a row, left padding)."""
    path, ref, _, _ = qwen35
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    prompts, n = _prompts(cfg.vocab_size), 10
    run = jax.jit(lambda p, pr: decode.generate(cfg, p, pr, jax.random.key(0), max_new_tokens=n,
                                                temperature=0))  # fmt: skip
    tokens, valid, _ = run(params, prompts)
    assert bool(jnp.all(valid))
    for row in range(prompts.tokens.shape[0]):
        seg = np.asarray(prompts.segment_ids[row])
        ids = torch.from_numpy(np.asarray(prompts.tokens[row])[seg == seg[-1]][None]).long()
        with torch.no_grad():
            out = ref.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))  # fmt: skip
        np.testing.assert_array_equal(np.asarray(tokens[row]), out[0, ids.shape[1] :].numpy())


def test_sampler_on_the_training_mesh_equals_one_device(qwen35):
    """The on-policy sampler of a Qwen3.5 student on dp=2 x fsdp=2 (its weights, the linear
    layers' too, fully sharded by the student's table) samples what one device does."""
    import optax

    from student import train
    from student.generate import Sampler
    from tests.test_generate import _mesh as student_mesh

    path, _, _, _ = qwen35
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    prompts = Prompts(*(jnp.tile(x, (2, 1))[:4] for x in _prompts(cfg.vocab_size)))
    kw = dict(seq_len=16, max_new_tokens=8, temperature=1.0, top_p=0.9, stop=(2,),
              vocab_limit=90, dtype="float32")  # fmt: skip
    four = student_mesh(2, 2)
    placed = jax.device_put(params, train.state_shardings(cfg, optax.sgd(0.1), four).params)
    key = jax.random.key(7)
    ref, s_ref = Sampler(cfg, student_mesh(1, 1), **kw)(params, prompts, key)
    got, s_got = Sampler(cfg, four, **kw)(placed, prompts, key)
    assert int(s_ref["tokens"]) == int(s_got["tokens"]) > 4
    assert float(s_got["logp"]) == pytest.approx(float(s_ref["logp"]), rel=1e-5)
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_student_steps_on_dp_x_fsdp_equal_one_device(qwen35):
    """Two distillation steps of a fresh student of the checkpoint's config on dp = 2 x
    fsdp = 2 (the student's table splits the linear layers' projections over fsdp, their
    convolution, decays and norm replicated; the mixture's experts split over fsdp) equal
    the steps on one device: losses, and parameters after SGD (equal gradients). Fresh
    weights: the checkpoint's O(1) ones give gradients of norm 50-180 whose float32
    summation order alone moves them by 1e-4 relative, whatever the layout."""
    import optax
    from jax.sharding import PartitionSpec as P

    from distill.config import DistillLossConfig
    from distill.types import TeacherOutput
    from student import sharding, train
    from tests.test_generate import _mesh as student_mesh

    path, _, _, batch = qwen35
    cfg = hf.read_model_config(path)
    params = jax.device_get(model.init_params(cfg, 0))  # host arrays: the steps donate
    rows = jax.tree.map(lambda x: np.concatenate([x, x[::-1]]), batch)  # 4 rows
    rng = np.random.default_rng(0)
    vals, ids = jax.lax.top_k(jax.nn.log_softmax(rng.normal(size=(4, 24, 96)) * 3), 8)
    teacher = TeacherOutput(np.asarray(vals, np.float32), np.asarray(ids, np.int32))
    specs = sharding.param_specs(cfg, 2)["layers"]
    assert specs["lin_wq"] != P() and specs["lin_conv_q"] == P()

    def run(dp, fsdp):
        mesh, tx = student_mesh(dp, fsdp), optax.sgd(0.1)
        step = train.make_train_step(cfg, tx, mesh, loss_cfg=DistillLossConfig(alpha=0.5),
                                     lr_schedule=lambda _: 0.1)  # fmt: skip
        state, losses = train.init_state(cfg, tx, 0, mesh, params), []
        for _ in range(2):
            state, metrics = step(state, rows, teacher)
            losses.append(float(metrics["loss"]))
        return jax.device_get(state.params), losses

    (one, l1), (four, l4) = run(1, 1), run(2, 2)
    np.testing.assert_allclose(l4, l1, rtol=2e-6)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(four), strict=True):
        np.testing.assert_allclose(b, a, atol=5e-7, rtol=1e-5)


def test_depth_pruned_student_keeps_the_hybrid_pattern(qwen35, corpus_dir, tmp_path):
    """student.init: from_teacher with 3 of the 4 layers: the kept layers (0, 2, 3) keep
    their kinds (linear, linear, full; the mixture its experts), and the student's log-probs
    are those of the transformers model with the same layers kept."""
    from distill.config.load import config_from_dict
    from tests.test_families import pruned_reference
    from tests.test_hf import _cfg_tree

    path, _, _, batch = qwen35
    tree = _cfg_tree(corpus_dir, tmp_path / "out", path)
    tree["mesh"]["teacher"]["tp"] = 1
    tree["student"] = {"init": "from_teacher", "model": {"n_layers": 3}}
    cfg = config_from_dict(tree)
    kept, s = cfg.init_layers(), cfg.student_model()
    assert kept == [0, 2, 3] and s.types() == ("linear", "linear", "full")
    assert s.n_experts == cfg.teacher.model.n_experts
    params = read_hf_layers(path, cfg.teacher.model, kept)
    got = model.apply(s, params, batch.tokens, batch.segment_ids, batch.positions)
    want = per_document_logprobs(pruned_reference(path, kept), batch)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg="pruned")
