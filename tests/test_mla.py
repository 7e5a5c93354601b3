"""Multi-head latent attention (`distill.models.mla`) and the RoPE variants
(`distill.models.rope`) against transformers on tiny random weights: DeepSeek-V3's attention
module and whole decoder (YaRN scaling with mscale_all_dim, interleaved RoPE), YaRN's
frequencies and attention factor, GLM-4.5's partial rotary and DeepSeek's interleaved
rotation; the tensor-parallel teacher at tp=2 and 4 and the fully sharded student against
one device; gradients through a rematerialised blockwise MLA student; the KV cache against
the full forward; the FLOP count against XLA's."""

import functools

import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from transformers import modeling_rope_utils  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402
from transformers.models.glm4_moe import modeling_glm4_moe as hf_glm  # noqa: E402

from distill import mesh as meshes  # noqa: E402
from distill.config import ModelConfig, RopeScaling  # noqa: E402
from distill.mesh import DP, FSDP, teacher_mesh  # noqa: E402
from distill.models import attention, counts, decode, model, rope  # noqa: E402
from distill.models.kernels import ring  # noqa: E402
from distill.types import Batch, Prompts  # noqa: E402
from pipelines.commands.cli import main  # noqa: E402
from student import sharding as student_sharding  # noqa: E402
from student import train  # noqa: E402
from teacher import sharding as teacher_sharding  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from tests.conftest import read_evals, tiny_config, train_by_step, write_config  # noqa: E402

# DeepSeek-V3's rope_scaling, shrunk: positions past the original 16 are extended 4x
YARN = dict(
    rope_type="yarn", factor=4.0, rope_theta=1e4, original_max_position_embeddings=16,
    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8,
)  # fmt: skip
DIMS = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6)


def _scaling(params: dict) -> RopeScaling:
    keys = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    return RopeScaling(type=params["rope_type"], **keys)


def _cfg(q_lora_rank=12, **over) -> ModelConfig:
    """The distill config of `_hf_model`'s model."""
    fields = dict(
        vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=64, norm_eps=1e-6,
        rope_theta=1e4, rope_scaling=_scaling(YARN), rope_interleave=True,
        q_lora_rank=q_lora_rank, attention="reference", **DIMS,
    )  # fmt: skip
    return ModelConfig(**{**fields, **over})


def _hf_model(q_lora_rank=12, interleave=True):
    """A tiny DeepSeek-V3 (dense feed-forwards: first_k_dense_replace covers every layer),
    random O(1) weights, float32, eager attention."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, first_k_dense_replace=2, n_routed_experts=4, n_group=1,
        topk_group=1, rope_parameters=dict(YARN), max_position_embeddings=64,
        rope_interleave=interleave, tie_word_embeddings=False, rms_norm_eps=1e-6, **DIMS,
    )  # fmt: skip
    config._attn_implementation = "eager"
    m = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.3)
    return m


# distill layer weight -> (transformers name after `model.layers.{i}.`, stored [out, in]):
# the test's own map, independent of distill's loader
NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wq_a": ("self_attn.q_a_proj.weight", True),
    "q_a_norm": ("self_attn.q_a_layernorm.weight", False),
    "wq_b": ("self_attn.q_b_proj.weight", True),
    "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", True),
    "kv_a_norm": ("self_attn.kv_a_layernorm.weight", False),
    "wkv_b": ("self_attn.kv_b_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def _params(hf, cfg: ModelConfig) -> dict:
    """transformers' weights in distill's layout (layers stacked, matrices [in, out])."""
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}

    def layer(key, i):
        name, transposed = NAMES[key]
        w = sd[f"model.layers.{i}.{name}"]
        return w.T if transposed else w

    keys = model.abstract_params(cfg)["layers"]
    layers = {k: np.stack([layer(k, i) for i in range(cfg.n_layers)]) for k in keys}
    return {
        "embed": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"],
        "lm_head": sd["lm_head.weight"].T,
        "layers": layers,
    }


def _batch(b=2, s=24, seed=0) -> Batch:
    """Packed rows: two documents (positions restarting), then a row of one."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 96, (b, s)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    seg[0, 10:] = 2
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    pos[0, 10:] = np.arange(s - 10)
    return Batch(tokens, tokens, seg, pos, np.ones((b, s), np.float32))


# --- RoPE against transformers --------------------------------------------------------------


@pytest.mark.parametrize(
    "params,head_dim,partial",
    [
        (YARN, 64, 1.0),  # mscale != mscale_all_dim: an attention factor of their ratio
        # DeepSeek-V3's: mscale == mscale_all_dim, attention factor 1
        (dict(YARN, mscale=1.0, mscale_all_dim=1.0, factor=40.0), 64, 1.0),
        # gpt-oss: no mscale, the ramp's ends not rounded
        (
            dict(
                rope_type="yarn",
                factor=32.0,
                rope_theta=15e4,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position_embeddings=4096,
                truncate=False,
            ),
            64,
            1.0,
        ),  # fmt: skip
        (
            dict(
                rope_type="yarn",
                factor=8.0,
                rope_theta=1e6,
                attention_factor=1.3,
                original_max_position_embeddings=2048,
            ),
            128,
            0.5,
        ),  # fmt: skip
        (dict(rope_type="linear", factor=4.0, rope_theta=1e4), 32, 0.5),
    ],
)
def test_yarn_frequencies_and_attention_factor_are_transformers(params, head_dim, partial):
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=4 * params.get("original_max_position_embeddings", 512),
        rope_parameters=dict(params, partial_rotary_factor=partial),
    )  # fmt: skip
    init = modeling_rope_utils.ROPE_INIT_FUNCTIONS[params["rope_type"]]
    inv_freq, factor = init(config)
    cfg = ModelConfig(
        d_model=head_dim * 4, n_heads=4, head_dim=head_dim, rope_theta=params["rope_theta"],
        rope_scaling=_scaling(params), partial_rotary_factor=partial,
    )  # fmt: skip
    table = rope.rope_table(cfg, "full")
    np.testing.assert_allclose(np.asarray(table.inv_freq), inv_freq.numpy(), rtol=1e-6)
    assert table.factor == pytest.approx(factor, rel=1e-12)
    if params["rope_type"] == "yarn" and "mscale" not in params:
        assert factor != 1.0  # the factor is not trivially 1


def _rope_inputs(b=2, s=7, h=3, d=16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, s, h, d)).astype(np.float32)
    k = rng.normal(size=(b, s, 1, d)).astype(np.float32)
    pos = (rng.integers(0, 50, (b, s))).astype(np.int32)
    return q, k, pos


def _torch_heads_first(x):  # [B, S, H, d] -> torch [B, H, S, d]
    return torch.from_numpy(x).transpose(1, 2)


def test_partial_rotary_is_glm4_moe_s():
    config = transformers.Glm4MoeConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    q, k, pos = _rope_inputs()
    cos, sin = hf_glm.Glm4MoeRotaryEmbedding(config)(torch.from_numpy(q), torch.from_numpy(pos))
    hq, hk = hf_glm.apply_rotary_pos_emb(_torch_heads_first(q), _torch_heads_first(k), cos, sin)
    cfg = ModelConfig(d_model=64, n_heads=4, head_dim=16, partial_rotary_factor=0.5)
    assert cfg.rope_dim == 8
    table = rope.rope_table(cfg, "full")
    for ours, theirs in ((q, hq), (k, hk)):
        out = rope.apply_rope(jnp.asarray(ours), jnp.asarray(pos), table)
        np.testing.assert_allclose(out, theirs.transpose(1, 2).numpy(), atol=1e-6, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(out)[..., 8:], ours[..., 8:])  # not rotated


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_rotation_with_yarn_is_transformers(interleave):
    config = _hf_model(interleave=interleave).config
    q, k, pos = _rope_inputs(d=8)
    emb = hf_ds.DeepseekV3RotaryEmbedding(config)
    cos, sin = emb(torch.from_numpy(q), torch.from_numpy(pos))
    apply = hf_ds.apply_rotary_pos_emb_interleave if interleave else hf_ds.apply_rotary_pos_emb
    hq, hk = apply(_torch_heads_first(q), _torch_heads_first(k), cos, sin)
    cfg = _cfg(rope_interleave=interleave)
    table = rope.rope_table(cfg, "full")
    assert table.factor == pytest.approx(emb.attention_scaling) and table.factor != 1.0
    for ours, theirs in ((q, hq), (k, hk)):
        out = rope.apply_rope(jnp.asarray(ours), jnp.asarray(pos), table, interleave)
        np.testing.assert_allclose(out, theirs.transpose(1, 2).numpy(), atol=1e-6, rtol=1e-6)


# --- MLA against transformers ---------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("backend", ["reference", "blockwise", "prefix"])
def test_attention_is_deepseek_v3_attention(q_lora_rank, backend):
    """One block's attention output (o_proj's) for transformers' own input norm of x."""
    hf = _hf_model(q_lora_rank)
    cfg = _cfg(q_lora_rank)
    layer = hf.model.layers[0]
    assert layer.self_attn.scaling == pytest.approx(cfg.scale()) and cfg.scale() != 16**-0.5
    b, s = 2, 20
    rng = np.random.default_rng(3)
    x = rng.normal(size=(b, s, 32)).astype(np.float32)
    pos = np.tile(np.arange(10, 10 + s, dtype=np.int32), (b, 1))
    causal = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        h = layer.input_layernorm(torch.from_numpy(x))
        emb = hf.model.rotary_emb(h, torch.from_numpy(pos).long())
        want = layer.self_attn(h, emb, causal.expand(b, 1, s, s))[0].numpy()

    block = model.Block(cfg, nnx.Rngs(0))
    for key, w in _params(hf, cfg)["layers"].items():
        getattr(block, key)[...] = jnp.asarray(w[0])
    q, k, v, _ = block.qkv(jnp.asarray(x), jnp.asarray(pos), rope.rope_table(cfg, "full"))
    assert (q.shape, k.shape, v.shape) == ((b, s, 4, 16), (b, s, 4, 16), (b, s, 4, 6))
    seg = jnp.ones((b, s), jnp.int32)
    attend = lambda *a, **kw: attention.attention(*a, backend=backend, block_q=8, block_kv=8, **kw)  # noqa: E731
    o = attend(q, k, v, seg, scale=cfg.scale(), window=None, softcap=None)
    got = model.matmul(o.reshape(b, s, -1), block.wo[...])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "blockwise", "prefix", "cudnn"])
def test_decoder_layer_is_deepseek_v3_s_with_every_backend(backend):
    """One whole block (attention, residuals, dense MLP) through the Block's own call with
    each attention kernel (cudnn: its very call, run by JAX's XLA implementation)."""
    hf, cfg = _hf_model(12), _cfg(12)
    b, s = 2, 20
    x = np.random.default_rng(4).normal(size=(b, s, 32)).astype(np.float32)
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    causal = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None]
    layer = hf.model.layers[0]
    with torch.no_grad():
        h, position_ids = torch.from_numpy(x), torch.from_numpy(pos).long()
        emb = hf.model.rotary_emb(h, position_ids)
        want = layer(h, causal.expand(b, 1, s, s), position_ids, position_embeddings=emb)
    block = model.Block(cfg, nnx.Rngs(0))
    for key, w in _params(hf, cfg)["layers"].items():
        getattr(block, key)[...] = jnp.asarray(w[0])
    kw = dict(backend=backend, block_q=8, block_kv=8, interpret=backend == "cudnn")
    attend = functools.partial(attention.attention, **kw)
    seg = jnp.ones((b, s), jnp.int32)
    got, _ = block(jnp.asarray(x), seg, jnp.asarray(pos), None, backend, attend=attend)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5, rtol=1e-5)


def _assert_decoder_is(hf, cfg: ModelConfig):
    """distill's logits of packed rows equal transformers' on each document alone."""
    params, batch = _params(hf, cfg), _batch()
    ours = np.asarray(model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions))
    for row in range(2):
        for doc in np.unique(batch.segment_ids[row]):
            at = batch.segment_ids[row] == doc
            with torch.no_grad():
                want = (
                    hf(
                        input_ids=torch.from_numpy(batch.tokens[row][at])[None].long(),
                        position_ids=torch.from_numpy(batch.positions[row][at])[None].long(),
                    )
                    .logits[0]
                    .numpy()
                )
            np.testing.assert_allclose(ours[row][at], want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_decoder_logits_are_deepseek_v3_s(q_lora_rank):
    _assert_decoder_is(_hf_model(q_lora_rank), _cfg(q_lora_rank))


GPT_OSS_YARN = dict(
    rope_type="yarn", factor=8.0, rope_theta=1e4, original_max_position_embeddings=4096,
    beta_fast=32.0, beta_slow=1.0, truncate=False,
)  # fmt: skip
# grouped-query families with the new RoPE variants: (transformers config class, model
# class, its config keys, distill's)
GQA_FAMILIES = {
    "glm4_moe_dense_partial_rotary_biases_qk_norm": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=True,
            first_k_dense_replace=2,
            n_routed_experts=4,
            moe_intermediate_size=16,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            },
        ),  # fmt: skip
        dict(partial_rotary_factor=0.5, qkv_bias=True, qk_norm=True),
    ),
    "llama_yarn_untruncated": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_parameters=dict(GPT_OSS_YARN)),
        dict(rope_scaling=_scaling(GPT_OSS_YARN)),
    ),
}


@pytest.mark.parametrize("family", sorted(GQA_FAMILIES))
def test_grouped_query_decoders_with_new_rope_are_transformers(family):
    config_class, model_class, hf_keys, keys = GQA_FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=False, rms_norm_eps=1e-6, **hf_keys,
    )  # fmt: skip
    config._attn_implementation = "eager"
    hf = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.3)
    cfg = ModelConfig(
        vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64,
        norm_eps=1e-6, rope_theta=1e4, attention="reference", **keys,
    )  # fmt: skip
    assert cfg.rope_dim == 16 * keys.get("partial_rotary_factor", 1.0)
    _assert_decoder_is(hf, cfg)


# --- sharded against one device -------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_teacher_is_one_device(tp, q_lora_rank):
    cfg = _cfg(q_lora_rank, attention="blockwise")
    params, batch = model.init_params(cfg, 1), _batch()
    ref = np.asarray(model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions))
    mesh = teacher_mesh(jax.devices()[:tp], 1, tp)
    sharded = teacher_sharding.shard_params(params, cfg, mesh)
    layers = sharded["layers"]
    assert layers["wkv_b"].sharding.spec == jax.P(None, None, "tp")
    assert layers["wkv_a"].sharding.spec == jax.P(None, None, None)
    # each shard holds whole heads of the up projection: H / tp of nope + v columns
    assert layers["wkv_b"].addressable_shards[0].data.shape[-1] == 4 // tp * (8 + 6)
    for sequence_parallel in (True, False):  # the latents gathered, or the input
        out = make_forward(cfg, mesh, mode="logits", sequence_parallel=sequence_parallel)
        np.testing.assert_allclose(np.asarray(out(sharded, batch)), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("pp,cp", [(2, 1), (1, 2)])
def test_teacher_with_stages_or_a_ring_is_one_device(pp, cp, monkeypatch):
    """tp = 2 with pipeline stages, or with context parallelism (ring attention, its
    key/value blocks passed around the ring rather than gathered)."""
    monkeypatch.setattr(ring, "GATHER_MAX_BYTES", 0)
    cfg = _cfg(12, attention="blockwise")
    params, batch = model.init_params(cfg, 1), _batch()
    ref = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    mesh = teacher_mesh(jax.devices()[: 2 * pp * cp], 1, 2, 1, pp, cp)
    sharded = teacher_sharding.shard_params(params, cfg, mesh)
    put = jax.device_put(batch, teacher_sharding.batch_sharding(mesh))
    out = make_forward(cfg, mesh, mode="dense", microbatch=1)(sharded, put)
    want = np.asarray(jax.nn.log_softmax(ref))
    np.testing.assert_allclose(np.asarray(out.logprobs), want, atol=2e-5, rtol=1e-5)


def _ce(cfg, params, batch):
    """Plain masked mean next-token cross-entropy from the full logits."""
    logits = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch.targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * batch.mask) / jnp.sum(batch.mask)


@pytest.mark.parametrize("remat", ["none", "block"])
def test_student_gradients_on_the_sharded_mesh_are_plain_jax_grad(remat):
    """The student's loss and gradients, blockwise attention (its own backward) on a
    2 x 4 dp x fsdp mesh, against jax.grad of the plain math on one device."""
    cfg = _cfg(12, attention="blockwise")
    params = model.init_params(cfg, 2)
    rng = np.random.default_rng(5)
    batch = _batch(b=8)
    batch = batch._replace(
        targets=rng.integers(0, 96, batch.tokens.shape).astype(np.int32),
        mask=(rng.random(batch.tokens.shape) > 0.2).astype(np.float32),
    )
    ref_cfg = cfg.model_copy(update={"attention": "reference"})
    ref_loss, ref_grads = jax.value_and_grad(_ce, argnums=1)(ref_cfg, params, batch)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), (DP, FSDP))
    specs = student_sharding.param_specs(cfg, 4)
    assert specs["layers"]["wq_b"] != jax.P() and specs["layers"]["kv_a_norm"] == jax.P()
    placed = jax.device_put(params, train.param_shardings(cfg, mesh))
    loss_fn = train.make_loss_fn(cfg, None, "float32", None, remat, mesh)
    (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(placed, batch, None)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        want = ref_grads
        for key in path:
            want = want[key.key]
        assert np.all(np.isfinite(np.asarray(g))), path
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-4, atol=1e-6)


def test_bfloat16_forward_is_close_to_float32():
    cfg = _cfg(12)
    params, batch = model.init_params(cfg, 0), _batch()
    args = (batch.tokens, batch.segment_ids, batch.positions)
    f32 = model.apply(cfg, params, *args)
    bf16 = model.apply(cfg, params, *args, dtype="bfloat16")
    assert bf16.dtype == np.float32
    np.testing.assert_allclose(np.asarray(bf16), np.asarray(f32), atol=0.05)


def _sgd_step(cfg, mesh, params, batch):
    """The student's params after one CE step of plain SGD on `mesh` (on the host)."""
    tx = optax.sgd(0.1)
    step = train.make_train_step(
        cfg, tx, mesh, loss_cfg=None, lr_schedule=optax.constant_schedule(0.1),
        with_teacher=False,
    )  # fmt: skip
    state, metrics = step(train.init_state(cfg, tx, 0, mesh, params), batch)
    return jax.device_get(state.params), float(metrics["loss"])


def test_context_parallel_student_step_is_one_device(monkeypatch):
    """A dp x fsdp x cp = 1 x 2 x 2 student (each row's positions over the cp ring, the
    ring's key/value blocks passed around it) takes the one-device step."""
    monkeypatch.setattr(ring, "GATHER_MAX_BYTES", 0)
    cfg = _cfg(12, attention="blockwise")
    params = jax.device_get(model.init_params(cfg, 4))
    batch = _batch(b=2)._replace(mask=np.ones((2, 24), np.float32))
    want, want_loss = _sgd_step(cfg, Mesh(np.array(jax.devices()[:1]), (DP,)), params, batch)
    got, loss = _sgd_step(cfg, meshes.student_mesh(jax.devices()[:4], 1, 2, 2), params, batch)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5)


# --- decoding and FLOPs ---------------------------------------------------------------------


def test_cached_decoding_is_the_full_forward():
    """Prefill a prompt, feed 4 tokens through the cache: each step's logits are the full
    forward's at that position, with the cache's v narrower than its k."""
    cfg = _cfg(12)
    params = model.init_params(cfg, 3)
    rng = np.random.default_rng(1)
    p, n, b = 6, 4, 2
    tokens = rng.integers(0, 96, (b, p + n)).astype(np.int32)
    pos = np.tile(np.arange(14, 14 + p + n, dtype=np.int32), (b, 1))  # past the original 16
    full = np.asarray(model.apply(cfg, params, tokens, np.ones_like(tokens), pos))
    prompts = Prompts(
        jnp.asarray(tokens[:, :p]), jnp.ones((b, p), jnp.int32), jnp.asarray(pos[:, :p])
    )
    logits, cache = decode.prefill(cfg, params, prompts, p + n, dtype="float32")
    assert cache.k.shape[-1] == 16 and cache.v.shape[-1] == 6
    np.testing.assert_allclose(np.asarray(logits), full[:, p - 1], atol=2e-5, rtol=1e-5)
    step = jax.jit(
        lambda tok, at, i, c: decode.decode_step(
            cfg, params, tok, at, i, jnp.ones((b,), bool), c, dtype="float32"
        )
    )
    for t in range(p, p + n - 1):
        logits, cache = step(jnp.asarray(tokens[:, t]), jnp.asarray(pos[:, t]), t, cache)
        np.testing.assert_allclose(np.asarray(logits), full[:, t], atol=2e-5, rtol=1e-5)


def test_flops_per_token_is_xla_s_count():
    """The plan's FLOP count of an MLA model against XLA's cost analysis of its loop-free
    forward (layers unrolled, the plain attention math), which also counts elementwise ops
    (within 1.5%; a GQA model of these sizes is within 0.9%): the kernels take values of
    their own width, so PV is counted over v_dim, not padded to the q/k width."""
    cfg = ModelConfig(
        vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=1024,
        kv_lora_rank=128, q_lora_rank=96, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=48, attention="reference",
    )  # fmt: skip
    b, s = 1, 512
    ids = jax.ShapeDtypeStruct((b, s), np.int32)
    fwd = jax.jit(lambda p, t, g, q: model.apply(cfg, p, t, g, q, unroll=True))
    compiled = fwd.lower(model.abstract_params(cfg), ids, ids, ids).compile()
    cost = compiled.cost_analysis()
    counted = (cost[0] if isinstance(cost, list) else cost)["flops"] / (b * s)
    assert counted == pytest.approx(counts.flops_per_token(cfg, s), rel=0.015)
    assert counts.param_count(cfg) == sum(
        x.size for x in jax.tree.leaves(model.init_params(cfg, 0))
    )


def test_a_tiny_run_distils_a_latent_attention_teacher_into_a_latent_student(tmp_path, corpus_dir):
    """`distill run` end to end, both roles DeepSeek-shaped (MLA, YaRN, interleaved RoPE):
    the teacher bootstrap, its tp = 2 forward, the student's steps and evaluation (the
    teacher's scores of the student's own samples among them)."""
    out = tmp_path / "out"
    tree = tiny_config(str(corpus_dir), str(out))
    latent = dict(q_lora_rank=12, rope_interleave=True, **DIMS)
    yarn = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
    tree["teacher"]["model"].update(
        n_kv_heads=4, rope_scaling={"type": "yarn", **yarn}, attention="blockwise", **latent
    )
    tree["student"]["model"].update(n_kv_heads=2)
    assert main(["run", write_config(tmp_path, tree)]) == 0
    steps = train_by_step(out)
    assert sorted(steps) == [2, 4, 6] and all(np.isfinite(r["loss"]) for r in steps.values())
    final = read_evals(out)[-1]  # with the student's samples, drawn through the KV cache
    assert final["step"] == 6 and final["teacher_loss"] < np.log(260)  # it learnt something
    assert np.isfinite([final["student_loss"], final["kl"], final["sample_kl"]]).all()


# --- the config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(v_head_dim=None), "v_head_dim: latent attention"),
        (dict(n_kv_heads=2), "n_kv_heads: latent attention"),
        (dict(qk_norm=True), "qk_norm: not with latent"),
        (dict(kv_lora_rank=None), "q_lora_rank: set only with latent"),
        (dict(qk_rope_head_dim=5), "even number"),
    ],
)
def test_latent_attention_config_names_the_wrong_field(over, match):
    with pytest.raises(ValueError, match=match):
        _cfg(12, **over)


def test_existing_families_keep_their_shapes_and_scale():
    cfg = ModelConfig(d_model=64, n_heads=4)
    assert (cfg.hd, cfg.v_dim, cfg.rope_dim, cfg.mla) == (16, 16, 16, False)
    assert cfg.scale() == 16**-0.5
    # YaRN's mscale_all_dim scales the softmax only under latent attention (DeepSeek)
    yarn = cfg.model_copy(update={"rope_scaling": _scaling(YARN)})
    assert yarn.scale() == 16**-0.5
