"""Attention sinks (gpt-oss) and values of another width than queries and keys (DeepSeek-V3's
MLA) in every attention kernel, against the plain reference, and the reference against
transformers' gpt_oss `eager_attention_forward`.

Inputs are packed rows (documents crossing block edges, trailing padding, a row all
padding), grouped-query heads (8 query / 2 key-value), a length no block divides, sink
logits of either sign and up to a few units (large enough to take much of a query's mass),
and values narrower (8) or wider (24) than the 16-wide queries and keys. Values and
gradients wrt q, k, v and the sinks must match the reference to 1e-5 of its largest
magnitude (float32; 2e-2 in bfloat16). Off their hardware splash runs in Pallas interpret
mode and cudnn's call with JAX's XLA implementation (`interpret=True`); on CUDA and TPU
they are lowered (`-m gpu` runs the cuDNN kernel itself). Then ring attention at cp = 2 and
4, decoding with a cache, and whole models: the teacher at tp = 1, 2, 4 and cp = 2, and the
student's step at cp = 2, each against one device.
"""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distill.config import DistillLossConfig, ModelConfig, OptimConfig
from distill.mesh import student_mesh, teacher_mesh
from distill.models import attention as attention_module
from distill.models import counts, decode, model
from distill.models.attention import _is_cuda, attention, over_rows
from distill.models.kernels.ring import from_cp_layout, ring_attention, to_cp_layout
from distill.types import Batch, Prompts, TeacherOutput
from student import optim, sharding, train
from student.context import Context
from teacher.forward import make_forward
from teacher.sharding import batch_sharding, shard_params

B, S, H, KV, HD = 3, 72, 8, 2, 16
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
NAMES = ("out", "dq", "dk", "dv", "dsinks")


@pytest.fixture(autouse=True)
def _on_the_cpu(request):
    """Pin each test to the CPU it is written for, unless it is a GPU test."""
    if request.node.get_closest_marker("gpu"):
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _segments(b=B, s=S) -> np.ndarray:
    seg = np.zeros((b, s), np.int32)
    seg[0, :20], seg[0, 20:51], seg[0, 51:66] = 1, 2, 3  # three documents, then padding
    seg[1, :] = 1  # one document across every block
    # row 2 stays all padding (segment 0)
    return seg


def _inputs(dtype, hd_v, seed=0):
    kq, kk, kv, kw, ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(kq, (B, S, H, HD), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, KV, HD), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, KV, hd_v), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (B, S, H, hd_v), jnp.float32)  # a loss that weighs every output
    sinks = 2.0 * jax.random.normal(ks, (H,), jnp.float32)
    return q, k, v, w, sinks, jnp.asarray(_segments())


def _value_and_grads(attend, dtype, hd_v, window=None, with_sinks=True):
    """[out, dq, dk, dv, dsinks] of sum(attend(...) * w) as float32 numpy; `window` goes in
    as a traced argument when it is an array (a layer's, under the layer scan)."""
    q, k, v, w, sinks, seg = _inputs(dtype, hd_v)

    def loss(q, k, v, sinks, window):
        o = attend(q, k, v, seg, window=window, sinks=sinks if with_sinks else None)
        return jnp.sum(o.astype(jnp.float32) * w), o

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, out), grads = jax.jit(grad, static_argnums=() if _traced(window) else (4,))(
        q, k, v, sinks, window
    )
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def _traced(window) -> bool:
    return window is not None and not isinstance(window, int)


@functools.cache
def _reference(dtype, hd_v, window, softcap, with_sinks):
    attend = functools.partial(attention, backend="reference", softcap=softcap)
    return _value_and_grads(attend, dtype, hd_v, window, with_sinks)


def _assert_close(got, want, tol, label):
    for name, g, r in zip(NAMES, got, want, strict=True):
        assert np.isfinite(g).all(), f"{label} {name} has NaN/inf (all-padding row?)"
        scale = np.abs(r).max()
        if scale == 0:  # no sinks: their gradient is zero on both sides
            np.testing.assert_array_equal(g, r, err_msg=f"{label} {name}")
            continue
        err = np.abs(g - r).max() / scale
        assert err <= tol, f"{label} {name}: relative error {err:.2e}"


BACKENDS = {  # name: attention keywords
    "blockwise": dict(backend="blockwise", block_q=16, block_kv=24),  # unequal, S padded to 96
    "prefix": dict(backend="prefix", block_q=32),  # blocks of 32, 32 and 8 queries
    "splash": dict(backend="splash", block_q=128, block_kv=128, interpret=True),
    "cudnn": dict(backend="cudnn", interpret=True),
}
CASES = {  # name: (dtype, hd_v, window, softcap, sinks)
    "narrow-v": (jnp.float32, 8, None, None, True),
    "wide-v-window": (jnp.float32, 24, 11, None, True),
    "traced-window": (jnp.float32, 8, jnp.int32(11), None, True),
    "softcap": (jnp.float32, 16, 11, 3.0, True),
    "bf16": (jnp.bfloat16, 8, 11, None, True),
    "narrow-v-no-sinks": (jnp.float32, 8, None, None, False),
}
CANNOT = {("splash", "traced-window"), ("cudnn", "softcap")}  # refused: see below


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_matches_reference(backend, case):
    if (backend, case) in CANNOT:
        pytest.skip("this backend refuses this model (test_what_cannot_run_is_refused)")
    dtype, hd_v, window, softcap, with_sinks = CASES[case]
    want = _reference(dtype, hd_v, window if window is None else int(window), softcap, with_sinks)
    attend = functools.partial(attention, softcap=softcap, **BACKENDS[backend])
    got = _value_and_grads(attend, dtype, hd_v, window, with_sinks)
    _assert_close(got, want, TOL[dtype], f"{backend} {case}")


def test_splash_per_device_rows_sums_the_sinks_gradient():
    """`over_rows`: splash on each device's own rows (3 devices, a row each) under an
    unchecked `shard_map`, the sinks on every device and their gradient summed over them."""
    rows = NamedSharding(Mesh(np.array(jax.devices()[:B]), ("dp",)), P("dp"))
    attend = over_rows("splash", rows, interpret=True, block_q=128, block_kv=128)
    want = _reference(jnp.float32, 8, 11, None, True)
    _assert_close(_value_and_grads(attend, jnp.float32, 8, 11), want, 1e-5, "over_rows")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_on_tensor_parallel_heads(backend):
    """Inside the teacher's checked `shard_map`, heads split over tp = 2 (each shard its
    query heads' sinks): the forward equals the reference on all heads."""
    q, k, v, _, sinks, seg = _inputs(jnp.float32, 8)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    heads = P(None, None, "tp")

    def local(q, k, v, seg, sinks):
        return attention(q, k, v, seg, window=11, sinks=sinks, **BACKENDS[backend])

    run = jax.shard_map(
        local, mesh=mesh, in_specs=(heads,) * 3 + (P(), P("tp")), out_specs=heads
    )  # fmt: skip
    got = jax.jit(run)(q, k, v, seg, sinks)
    want = attention(q, k, v, seg, backend="reference", window=11, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_reference_is_transformers_gpt_oss():
    """The reference's output is transformers' gpt_oss eager attention on the same numbers,
    under the same mask (causal, same document, a 11-token window) written as its additive
    mask."""
    torch = pytest.importorskip("torch")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v, _, sinks, seg = _inputs(jnp.float32, 8)
    scale, window = 0.3, 11
    got = attention(q, k, v, seg, backend="reference", scale=scale, window=window, sinks=sinks)
    pos = np.arange(S)
    seen = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
    seen = seen[None] & (np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :])
    additive = np.where(seen, 0.0, np.finfo(np.float32).min)[:, None].astype(np.float32)
    heads = lambda x: torch.tensor(np.asarray(x)).transpose(1, 2)  # noqa: E731 [B, heads, S, d]
    module = types.SimpleNamespace(
        num_key_value_groups=H // KV, sinks=torch.tensor(np.asarray(sinks)), training=False
    )
    want, _ = gpt_oss.eager_attention_forward(
        module, heads(q), heads(k), heads(v), torch.tensor(additive), scaling=scale
    )
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-6, rtol=1e-5)


def test_what_cannot_run_is_refused():
    """splash takes one static window; cudnn has no soft-capping (sinks or not)."""
    q, k, v, _, sinks, seg = _inputs(jnp.float32, 8)
    with pytest.raises(ValueError, match="splash takes one static window"):
        attention(q, k, v, seg, backend="splash", window=jnp.int32(4), sinks=sinks, interpret=True)
    with pytest.raises(ValueError, match="cudnn has no attention soft-capping"):
        attention(q, k, v, seg, backend="cudnn", softcap=2.0, sinks=sinks, interpret=True)
    with pytest.raises(ValueError, match="one per query head"):
        attention(q, k, v, seg, backend="reference", sinks=sinks[:KV])
    with pytest.raises(ValueError, match="v \\[B,S,KV,hd_v\\]"):
        attention(q, k, v[:, :, :1], seg, backend="reference")


# --- ring attention ----------------------------------------------------------------------


def _context_parallel(cp: int, **kw):
    """Whole rows in, whole rows out: laid out, split over `cp` devices, attended, back. The
    sinks go in replicated (their gradient is summed over the ring)."""
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    rows = P(None, "cp")

    def local(q, k, v, seg, sinks, window):
        return ring_attention(q, k, v, seg, axis="cp", sinks=sinks, window=window, **kw)

    def attend(q, k, v, seg, *, window, sinks):
        run = jax.shard_map(
            functools.partial(local, window=window),
            mesh=mesh, in_specs=(rows,) * 4 + (P(),), out_specs=rows,
        )  # fmt: skip
        laid = [to_cp_layout(x, cp) for x in (q, k, v, seg)]
        return from_cp_layout(run(*laid, sinks), cp)

    return attend


@pytest.mark.parametrize(
    "cp, exchange, hd_v, window",
    [(2, "ring", 8, None), (4, "ring", 24, 11), (4, "gather", 8, 11)],
)
def test_ring_attention_matches_one_device(cp, exchange, hd_v, window):
    """Each query's sink counts once however many ring steps its keys take. Chunks of 9
    (cp = 4) or 18 (cp = 2) tokens with tiles of 8: a chunk ends mid-tile."""
    want = _reference(jnp.float32, hd_v, window, None, True)
    attend = _context_parallel(cp, exchange=exchange, block_q=8, block_kv=8)
    got = _value_and_grads(attend, jnp.float32, hd_v, window)
    _assert_close(got, want, 1e-5, f"cp={cp} {exchange}")


@pytest.mark.parametrize("window", [None, jnp.int32(11)], ids=["full", "traced-window"])
def test_the_students_cp_attention_sums_the_sinks_gradient(window):
    """`student.context.Context.attend` on the step's pieces (each device's two chunks a row
    of its own, rows split over fsdp x cp): the sinks, replicated, get the whole rows'
    gradient."""
    cp = 2
    mesh = student_mesh(jax.devices()[:4], 1, 2, cp)
    context = Context(mesh)

    # back from the pieces' layout to whole rows: each device's slice in row order, then
    # the rows as the batch's sharding assembles them
    whole = jax.shard_map(
        lambda x: x, mesh=mesh, in_specs=sharding.pieces_spec(mesh),
        out_specs=sharding.batch_spec(mesh),
    )  # fmt: skip

    def attend(q, k, v, seg, *, window, sinks):
        # an even number of rows for fsdp: the three rows and a copy of the first (whose
        # output is dropped: nothing of it reaches the loss)
        q, k, v, seg = context.pieces(tuple(jnp.concatenate([x, x[:1]]) for x in (q, k, v, seg)))
        o = context.attend(q, k, v, seg, scale=None, window=window, softcap=None, sinks=sinks)
        return whole(context.unbalance(o))[:B]

    want = _reference(jnp.float32, 8, None if window is None else int(window), None, True)
    got = _value_and_grads(attend, jnp.float32, 8, window)
    _assert_close(got, want, 1e-5, "student cp")


# --- decoding ----------------------------------------------------------------------------


def test_cached_attention_is_the_last_query_of_the_reference():
    """One query against a cache longer than the row (entries past it invalid), a window,
    sinks and narrow values: the reference's output at the row's last position."""
    q, k, v, _, sinks, seg = _inputs(jnp.float32, 8)
    row = jnp.ones((1, S), jnp.int32)
    want = attention(q[1:2], k[1:2], v[1:2], row, backend="reference", window=11, sinks=sinks)
    pad = [(0, 0), (0, 5), (0, 0), (0, 0)]
    valid = jnp.arange(S + 5)[None] < S
    got = decode.cached_attention(
        q[1:2, -1:], jnp.pad(k[1:2], pad), jnp.pad(v[1:2], pad), valid, window=11,
        index=S - 1, sinks=sinks,
    )  # fmt: skip
    np.testing.assert_allclose(got[:, 0], want[:, -1], atol=1e-6, rtol=1e-5)


GPT_OSS_LIKE = ModelConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
    sliding_window=5, layer_types=("sliding", "full"), attn_sinks=True, attention="reference",
)  # fmt: skip


def _params(cfg=GPT_OSS_LIKE, seed=1):
    """Random parameters with sink logits of a few units (they start at zero)."""
    params = model.init_params(cfg, seed)
    shape = params["layers"]["sinks"].shape
    params["layers"]["sinks"] = 2.0 * jax.random.normal(jax.random.key(seed), shape)
    return params


def _packed(b=4, s=16, seed=0) -> Batch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, GPT_OSS_LIKE.vocab_size, (b, s)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    seg[0, 9:] = 2  # two documents in the first row
    seg[1, 13:] = 0  # trailing padding
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    pos[0, 9:] -= 9
    targets = rng.integers(0, GPT_OSS_LIKE.vocab_size, (b, s)).astype(np.int32)
    return Batch(tokens, targets, seg, pos, (seg > 0).astype(np.float32))


def test_decode_with_sinks_matches_the_full_forward():
    """Prefill then one token at a time: each step's logits are the full forward's."""
    cfg, params = GPT_OSS_LIKE, _params()
    tokens = _packed().tokens[:1]
    pos = np.arange(16, dtype=np.int32)[None]
    seg = np.ones_like(tokens)
    full = np.asarray(model.apply(cfg, params, tokens, seg, pos))
    p = 6
    prompt = Prompts(tokens[:, :p], seg[:, :p], pos[:, :p])
    logits, cache = decode.prefill(cfg, params, prompt, 16, dtype="float32")
    np.testing.assert_allclose(logits, full[:, p - 1], atol=1e-5, rtol=1e-5)
    for i in range(p, 16):
        logits, cache = decode.decode_step(
            cfg, params, tokens[:, i], pos[:, i], jnp.int32(i), jnp.ones((1,), bool), cache,
            dtype="float32",
        )  # fmt: skip
        np.testing.assert_allclose(logits, full[:, i], atol=1e-5, rtol=1e-5, err_msg=str(i))


# --- whole models on meshes --------------------------------------------------------------


@pytest.mark.parametrize(
    "dp, tp, pp, cp", [(1, 2, 1, 1), (1, 4, 1, 1), (1, 2, 1, 2), (2, 1, 1, 2), (1, 2, 2, 1)]
)
def test_teacher_with_sinks_matches_one_device(dp, tp, pp, cp):
    """The sinks split over tp with their query heads (tp = 4: more shards than KV heads,
    which are repeated; the sinks are not), over pipeline stages with their layers, and
    through the cp ring (blockwise kernel)."""
    cfg, params = GPT_OSS_LIKE, _params()
    batch = _packed()
    want = np.asarray(model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions))
    mesh = teacher_mesh(jax.devices()[: dp * tp * pp * cp], dp, tp, 1, pp, cp)
    sharded = shard_params(params, cfg, mesh)
    assert sharded["layers"]["sinks"].sharding.spec == P("pp" if pp > 1 else None, "tp")
    got = make_forward(cfg, mesh, mode="logits")(
        sharded, jax.device_put(batch, batch_sharding(mesh))
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)


OPT = OptimConfig(lr=1e-2, warmup_steps=1)


def _student_steps(dp, fsdp, cp):
    """(params after two steps, per-step metrics) of GPT_OSS_LIKE (blockwise attention)
    trained on a dp x fsdp x cp mesh with a top-k teacher."""
    cfg = GPT_OSS_LIKE.model_copy(update={"attention": "blockwise"})
    mesh = student_mesh(jax.devices()[: dp * fsdp * cp], dp, fsdp, cp)
    tx = optim.make_optimizer(OPT, 10)
    step = train.make_train_step(
        cfg, tx, mesh, loss_cfg=DistillLossConfig(temperature=2.0, alpha=0.7),
        lr_schedule=optim.schedule(OPT, 10),
    )  # fmt: skip
    state = train.init_state(cfg, tx, 0, mesh, jax.device_get(_params(cfg)))
    history = []
    for i in range(2):
        batch = _packed(seed=i)
        logits = np.random.default_rng(i).normal(size=(4, 16, cfg.vocab_size)) * 3
        vals, ids = jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32)), 6)
        state, metrics = step(state, batch, TeacherOutput(np.asarray(vals), np.asarray(ids)))
        history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return jax.device_get(state.params), history


def test_student_step_with_sinks_at_cp2_matches_one_device():
    """The sinks' gradient through the ring (summed over cp) and their fsdp layout: two
    AdamW steps give the single device's parameters, the sinks among them."""
    ref_params, ref = _student_steps(1, 1, 1)
    params, got = _student_steps(1, 2, 2)
    for a, b in zip(ref, got, strict=True):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), key
    moved = np.abs(ref_params["layers"]["sinks"] - np.asarray(_params()["layers"]["sinks"]))
    assert moved.min() > 0  # every sink was trained
    for x, y in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)


# --- lowering and the GPU ----------------------------------------------------------------


def test_cudnn_and_splash_lower_for_their_platforms(monkeypatch):
    """cudnn (the sink as one more key, values widened to the keys') lowers to cuDNN's
    fused attention for CUDA, and splash with its own sinks and narrow values to a Mosaic
    kernel for TPU, forward and backward, in bfloat16."""
    from tests.test_lowering import stub_gpu_probes

    stub_gpu_probes(monkeypatch)
    q, k, v, w, sinks, seg = _inputs(jnp.bfloat16, 8)
    for backend, target, kernel in [
        ("cudnn", "cuda", r"custom_call @__cudnn\$fmha"),
        ("splash", "tpu", r"custom_call @tpu_custom_call"),
    ]:
        attention_module.use_platform({"cuda": "gpu"}.get(target, target))
        try:

            def loss(q, k, v, sinks, backend=backend):
                o = attention(q, k, v, seg, backend=backend, window=11, sinks=sinks)
                return jnp.sum(o.astype(jnp.float32) * w)

            fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
            text = fn.trace(q, k, v, sinks).lower(lowering_platforms=(target,)).as_text()
        finally:
            attention_module.use_platform(None)
        assert len(re.findall(kernel, text)) >= 2, backend  # forward and backward


@pytest.mark.gpu
@pytest.mark.skipif(not _is_cuda(), reason="cuDNN flash attention needs a CUDA GPU")
@pytest.mark.parametrize("hd_v", [8, 24])
def test_cudnn_with_sinks_matches_reference_on_gpu(hd_v):
    want = _reference(jnp.bfloat16, hd_v, 11, None, True)
    got = _value_and_grads(functools.partial(attention, backend="cudnn"), jnp.bfloat16, hd_v, 11)
    _assert_close(got, want, TOL[jnp.bfloat16], "cudnn on the GPU")


def test_sinks_are_parameters_but_not_matmuls():
    """attn_sinks adds [n_layers, n_heads] parameters (none without it) and no matmul FLOPs."""
    plain = GPT_OSS_LIKE.model_copy(update={"attn_sinks": False})
    assert "sinks" not in model.init_params(plain, 0)["layers"]
    assert model.init_params(GPT_OSS_LIKE, 0)["layers"]["sinks"].shape == (2, 4)
    assert counts.param_count(GPT_OSS_LIKE) == counts.param_count(plain) + 2 * 4
    assert counts.flops_per_token(GPT_OSS_LIKE, 16) == counts.flops_per_token(plain, 16)
