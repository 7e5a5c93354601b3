"""distill.models.attention: each backend that runs here against the plain reference, and memory.

Equality is checked on packed rows (documents crossing block edges, trailing padding, a row
that is all padding), grouped-query heads (8 query / 2 key-value), and a length (200) that
no block size divides, in values and in gradients wrt q, k and v. Tolerances are relative
to the largest reference magnitude: 1e-5 for float32 inputs, 2e-2 for bfloat16 inputs
(both sides round probabilities and outputs to bfloat16, in different places).
Off their hardware, splash runs in Pallas interpret mode and cudnn's call runs with JAX's
XLA implementation (`interpret=True`); the cuDNN kernel itself needs a GPU (`-m gpu`).
Every other test runs on the CPU, whatever the machine has: the 1e-5 float32 tolerance is
the CPU's arithmetic (a GPU's matmuls use TF32 and another reduction order, and missed it
by 1.2e-5 and 5.6e-5 on an H200).

Memory is checked without running anything: XLA's compile-time analysis of the gradient
program at S = 2,048 and 4,096.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.models.attention import _is_cuda, attention, resolve_backend

B, S, H, KV, HD = 3, 200, 8, 2, 32
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _on_the_cpu(request):
    """Pin each test to the CPU it is written for, unless it is a GPU test."""
    if request.node.get_closest_marker("gpu"):
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _segments() -> np.ndarray:
    seg = np.zeros((B, S), np.int32)
    seg[0, :50], seg[0, 50:120], seg[0, 120:180] = 1, 2, 3  # three documents, then padding
    seg[1, :] = 1  # one document across every block
    # row 2 stays all padding (segment 0)
    return seg


def _inputs(dtype):
    kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, S, H, HD), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, KV, HD), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, KV, HD), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (B, S, H, HD), jnp.float32)  # a loss that weighs every output
    return q, k, v, w, jnp.asarray(_segments())


def _value_and_grads(backend, dtype, **kw):
    q, k, v, w, seg = _inputs(dtype)

    def loss(q, k, v):
        o = attention(q, k, v, seg, backend=backend, **kw)
        return jnp.sum(o.astype(jnp.float32) * w), o

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def _reference(dtype):
    return _reference_on(dtype, jax.config.jax_default_device)


@functools.cache
def _reference_on(dtype, device):  # the device: the GPU test's reference is the GPU's
    return _value_and_grads("reference", dtype)


def _assert_matches_reference(backend, dtype, **kw):
    got = _value_and_grads(backend, dtype, **kw)
    want = _reference(dtype)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert np.isfinite(g).all(), f"{backend} {name} has NaN/inf (all-padding row?)"
        err = np.abs(g - r).max() / np.abs(r).max()
        assert err <= TOL[dtype], f"{backend} {name}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "dtype, blocks",
    [
        (jnp.float32, dict(block_q=64, block_kv=48)),  # unequal blocks, S padded to 384
        (jnp.bfloat16, dict(block_q=64, block_kv=48)),
        (jnp.float32, dict()),  # default 512: clipped to one 200-long block
    ],
    ids=["f32-64x48", "bf16-64x48", "f32-default"],
)
def test_blockwise_matches_reference(dtype, blocks):
    _assert_matches_reference("blockwise", dtype, **blocks)


@pytest.mark.parametrize(
    "dtype, blocks",
    [
        (jnp.float32, dict(block_q=48)),  # four blocks of 48 and a last one of 8 queries
        (jnp.bfloat16, dict(block_q=48)),
        (jnp.float32, dict()),  # default 64: 64, 64, 64 and 8
        (jnp.float32, dict(block_q=512)),  # one block of all 200 queries
    ],
    ids=["f32-48", "bf16-48", "f32-default", "f32-one-block"],
)
def test_prefix_matches_reference(dtype, blocks):
    _assert_matches_reference("prefix", dtype, **blocks)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_splash_interpret_matches_reference(dtype):
    # The TPU kernel in Pallas interpret mode: runs on CPU with this JAX (S padded to 256).
    _assert_matches_reference("splash", dtype, block_q=128, block_kv=128, interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_cuda(), reason="cuDNN flash attention needs a CUDA GPU")
def test_cudnn_matches_reference():
    _assert_matches_reference("cudnn", jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cudnn_call_matches_reference_off_gpu(dtype):
    # cudnn's own call (same-document mask, scale, causal flag, grouped heads) made with
    # JAX's XLA implementation: what is ours in that backend, checked without a GPU.
    _assert_matches_reference("cudnn", dtype, interpret=True)


def test_off_platform_backends_fail_clearly():
    q, k, v, _, seg = _inputs(jnp.bfloat16)
    if not _is_cuda():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            attention(q, k, v, seg, backend="cudnn")
    if jax.default_backend() != "tpu":
        with pytest.raises(ValueError, match="TPU kernel"):
            attention(q, k, v, seg, backend="splash")
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention(q, k, v, seg, backend="flash")
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q[:, :, :3], k, v, seg, backend="reference")


def test_auto_picks_by_platform_and_dtype():
    platform = jax.default_backend()
    if platform == "cpu":
        assert resolve_backend("auto", jnp.bfloat16, 64) == "blockwise"  # any length
        assert resolve_backend("auto", jnp.float32, 64, 512) == "prefix"  # short rows
        assert resolve_backend("auto", jnp.float32, 64, 513) == "blockwise"
    if platform == "tpu":
        assert resolve_backend("auto", jnp.float32, 64) == "splash"
    if _is_cuda():
        assert resolve_backend("auto", jnp.bfloat16, 64) == "cudnn"
        assert resolve_backend("auto", jnp.float32, 64) == "blockwise"
    assert resolve_backend("reference", jnp.float32, 64) == "reference"


@pytest.mark.parametrize("widest, want", [(256, "cudnn"), (128, "blockwise")])
def test_auto_takes_cudnn_for_heads_as_wide_as_the_gpu_allows(monkeypatch, widest, want):
    """On CUDA (stubbed here): a 256-wide head (Qwen3.5, Gemma) goes to cuDNN on Hopper and
    later, where cuDNN takes it, and to blockwise before; 128 and under, cuDNN on either."""
    from distill.models import attention as attn

    monkeypatch.setattr(attn, "_is_cuda", lambda: True)
    monkeypatch.setattr(attn, "_cudnn_head_dim_max", lambda: widest)
    assert resolve_backend("auto", jnp.bfloat16, 256) == want
    assert resolve_backend("auto", jnp.bfloat16, 192) == want  # DeepSeek-V3's q/k heads
    assert resolve_backend("auto", jnp.bfloat16, 128) == "cudnn"
    assert resolve_backend("auto", jnp.bfloat16, 264) == "blockwise"


def test_the_meshes_platform_decides_not_the_default_backend(monkeypatch):
    """On a TPU (or GPU) host asked for CPU devices (`mesh.platform: cpu`, say a plan of a
    bigger slice on simulated devices), `auto` is prefix for short rows, else blockwise in
    CPU tiles: the devices' platform decides, which `available_devices` hands to attention,
    not JAX's default backend."""
    from distill.mesh import available_devices
    from distill.models import attention as attn

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # a TPU host
    monkeypatch.setattr(attn, "_platform", None)
    assert resolve_backend("auto", jnp.bfloat16, 64) == "splash"
    assert available_devices("cpu")[0].platform == "cpu"
    assert attn.platform() == "cpu"
    assert resolve_backend("auto", jnp.bfloat16, 64) == "blockwise"
    assert resolve_backend("auto", jnp.bfloat16, 64, S) == "prefix"
    seen = []
    monkeypatch.setattr(attn, "blockwise", lambda *args, **kw: seen.append(args[-2:]))
    q, k, v, _, seg = _inputs(jnp.float32)
    attention(q, k, v, seg, backend="blockwise")
    assert seen == [(attn.CPU_BLOCK, attn.CPU_BLOCK)]


def _grad_temp_bytes(backend: str, seq: int, heads=4, kv_heads=2, hd=64) -> int:
    """Scratch bytes XLA plans for forward + backward of one sequence (compiled, not run)."""
    f32 = jnp.float32
    q = jax.ShapeDtypeStruct((1, seq, heads, hd), f32)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, hd), f32)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def loss(q, k, v, seg):
        return jnp.sum(attention(q, k, v, seg, backend=backend))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return grad.lower(q, kv, kv, seg).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly():
    ref_2k, ref_4k = _grad_temp_bytes("reference", 2048), _grad_temp_bytes("reference", 4096)
    blk_2k, blk_4k = _grad_temp_bytes("blockwise", 2048), _grad_temp_bytes("blockwise", 4096)
    assert ref_4k / ref_2k > 3.5  # S x S scores: quadratic
    assert blk_4k / blk_2k <= 2.3  # blocks and O(S) residuals only
    one_head_scores = 4096 * 4096 * 4  # one float32 S x S array, 64 MiB
    assert blk_4k < one_head_scores, f"blockwise temp {blk_4k / 2**20:.1f} MiB"


def test_prefix_memory_stays_below_the_reference():
    """prefix holds several blocks' scores at once (XLA:CPU runs them concurrently), so it
    is only `auto`'s choice for short rows; there it needs well under the S x S math."""
    assert _grad_temp_bytes("prefix", 512) < 0.6 * _grad_temp_bytes("reference", 512)


# --- sliding windows and soft-capping ----------------------------------------------------

WINDOW, CAP = 37, 2.0  # a window no block size divides; a cap the scores (std ~1) reach


def _windowed(backend, dtype, window, softcap, traced, **kw):
    """Values and gradients with a window (a Python int, or `traced`: a jit argument, as a
    layer's window is under the layer scan) and a soft-cap."""
    q, k, v, w, seg = _inputs(dtype)

    def loss(q, k, v, window):
        o = attention(q, k, v, seg, backend=backend, window=window, softcap=softcap, **kw)
        return jnp.sum(o.astype(jnp.float32) * w), o

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    if traced:
        (_, out), grads = jax.jit(grad)(q, k, v, jnp.int32(window))
    else:
        (_, out), grads = jax.jit(functools.partial(grad, window=window))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


CAPPED = {  # id: (backend, dtype, softcap, traced window, kw)
    "blockwise-f32": ("blockwise", jnp.float32, CAP, True, dict(block_q=64, block_kv=48)),
    "blockwise-bf16": ("blockwise", jnp.bfloat16, CAP, False, dict(block_q=64, block_kv=48)),
    "blockwise-one-block": ("blockwise", jnp.float32, CAP, True, dict()),
    "prefix-f32": ("prefix", jnp.float32, CAP, True, dict(block_q=48)),
    "prefix-bf16-static": ("prefix", jnp.bfloat16, CAP, False, dict(block_q=48)),
    "cudnn-call-window": ("cudnn", jnp.float32, None, True, dict(interpret=True)),
    "splash-static": (
        "splash",
        jnp.float32,
        CAP,
        False,
        dict(block_q=128, block_kv=128, interpret=True),
    ),
}


@pytest.mark.parametrize("case", CAPPED)
def test_windows_and_softcaps_match_reference(case):
    backend, dtype, softcap, traced, kw = CAPPED[case]
    got = _windowed(backend, dtype, WINDOW, softcap, traced, **kw)
    want = _windowed("reference", dtype, WINDOW, softcap, False)
    plain = _reference(dtype)
    for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, want, plain, strict=True):
        assert np.isfinite(g).all(), f"{case} {name} has NaN/inf"
        err = np.abs(g - r).max() / np.abs(r).max()
        assert err <= TOL[dtype], f"{case} {name}: relative error {err:.2e}"
        assert np.abs(r - p).max() > 10 * TOL[dtype] * np.abs(p).max()  # window/cap matter


def test_reference_window_is_huggingface_mask():
    """kv_idx > q_idx - window, within the document: checked on the probabilities of one
    head (v = identity rows), so each output row is its attention row."""
    s, window = 12, 4
    seg = jnp.asarray([[1] * 7 + [2] * 5], jnp.int32)
    q = jnp.zeros((1, s, 1, s), jnp.float32)  # equal scores: uniform over the allowed keys
    v = jnp.eye(s, dtype=jnp.float32)[None, :, None, :]
    probs = np.asarray(attention(q, q, v, seg, backend="reference", window=window))[0, :, 0]
    qi, ki = np.arange(s)[:, None], np.arange(s)[None, :]
    same = np.asarray(seg[0])[:, None] == np.asarray(seg[0])[None, :]
    allowed = (ki <= qi) & (ki > qi - window) & same
    np.testing.assert_allclose(probs, allowed / allowed.sum(1, keepdims=True), atol=1e-6)
    full = attention(q, q, v, seg, backend="reference", window=s)
    np.testing.assert_allclose(full, attention(q, q, v, seg, backend="reference"), atol=0)


@pytest.mark.parametrize("window", [None, 1, 37, 64, 500])
@pytest.mark.parametrize("offset", [0, 100, -100, 1000])
def test_blockwise_visits_only_blocks_in_the_window(window, offset):
    """The key blocks each query block loops over (forward), and the query blocks each key
    block loops over (backward), are exactly those holding an allowed pair; also for
    queries `offset` positions after the keys (the spans of context parallelism)."""
    from distill.models.kernels.blockwise import _key_span, _query_span

    bq, bk, sp = 64, 48, 384
    nq, nk = sp // bq, sp // bk
    qi, ki = offset + np.arange(sp)[:, None], np.arange(sp)[None, :]
    allowed = (ki <= qi) & (True if window is None else ki > qi - window)
    needed = allowed.reshape(nq, bq, nk, bk).any(axis=(1, 3))
    for i in range(nq):
        first, stop = (int(x) for x in _key_span(i, window, bq, bk, nk, offset))
        assert list(range(first, stop)) == list(np.flatnonzero(needed[i])), i
    for j in range(nk):
        first, stop = (int(x) for x in _query_span(j, window, bq, bk, nq, offset))
        assert list(range(first, stop)) == list(np.flatnonzero(needed[:, j])), j


def test_backends_that_cannot_run_a_model_are_refused():
    from distill.config import ModelConfig

    q, k, v, _, seg = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="cudnn has no attention soft-capping"):
        attention(q, k, v, seg, backend="cudnn", softcap=CAP, interpret=True)
    with pytest.raises(ValueError, match="splash takes one static window"):
        attention(q, k, v, seg, backend="splash", window=jnp.int32(8), interpret=True)
    assert resolve_backend("auto", jnp.float32, 64, softcap=True, mixed_windows=True) in (
        "prefix", "blockwise"
    )  # fmt: skip
    with pytest.raises(ValueError, match="attention: cudnn has no attention soft-capping"):
        ModelConfig(attention="cudnn", attn_softcap=50.0)
    mixed = dict(n_layers=2, sliding_window=8, layer_types=("sliding", "full"))
    with pytest.raises(ValueError, match="attention: splash takes one static window"):
        ModelConfig(attention="splash", **mixed)
    ModelConfig(attention="splash", n_layers=2, sliding_window=8, attn_softcap=50.0)
