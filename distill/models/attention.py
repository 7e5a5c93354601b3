"""Causal, segment-aware, grouped-query attention, with backends that never form S x S.

One entry point, `attention(q, k, v, segment_ids, backend=...)`, for both roles. A token
attends to earlier tokens (itself included) of the same packed document: same segment id,
causal, and with a sliding `window` only the last `window` of those keys (itself included;
`kv_idx > q_idx - window`, as Hugging Face masks it). `softcap` caps the scaled scores at
cap * tanh(scores / cap) before the softmax (Gemma 2). Segment id 0 marks padding; it is
treated like any other id, so a padding row attends to the padding before it and is never
all-masked (no NaN). Heads are grouped-query: query head h reads key/value head h // G
(G = H / KV), the order of `q.reshape(B, S, KV, G, hd)`. Sizes are read off the arrays, so under
tensor parallelism the heads are this shard's local heads.

Every backend also takes `sinks` (gpt-oss): a float32 logit per query head [H] that joins
each query's softmax denominator and contributes no value (as transformers' gpt_oss
concatenates it to the scores and drops its column after the softmax; it is not
soft-capped), and values of another width than queries and keys (DeepSeek-V3's MLA:
v [B, S, KV, hd_v], output [B, S, H, hd_v]).

Backends:

- `reference`: the plain math (float32 [B, KV, G, S, S] scores, softmax): the test oracle.
- `blockwise`: flash-style XLA for any platform. An online softmax over key/value blocks
  for each query block, float32 scores, normaliser and output, and a `jax.custom_vjp`
  whose backward recomputes each block's scores from (q, k, v, o, logsumexp). Key blocks
  entirely above the causal diagonal, or entirely before a sliding window, are never
  visited. What is live is a few
  [B, KV, G, block_q, block_kv] float32 blocks and O(S) arrays; nothing grows as S^2.
- `prefix`: for short rows on CPU. Each block of `PREFIX_BLOCK` queries attends to its
  whole causal prefix of keys at once: static slices of one head-major copy of q, k and v,
  the blocks unrolled (no loop), a plain softmax per block (its keys are all there) and a
  `jax.custom_vjp` whose backward recomputes each block's probabilities from the saved
  logsumexp. Keys above the diagonal are skipped a block at a time, and XLA:CPU gets a few
  large fused ops instead of a loop of small tiles: at B=16, S=256, 4 heads, forward and
  backward took 31 ms against blockwise's 48 ms (PyTorch's SDPA: 21 ms). A block's scores
  are [B, KV, G, PREFIX_BLOCK, S], but XLA:CPU runs the blocks concurrently and keeps their
  scores live together, so memory grows as S^2 (forward and backward of one row of 4 heads:
  9 MiB at S = 512 and 33 MiB at 1,024, against the reference's 21 and 50 and blockwise's
  2 and 4): `auto` uses it only for rows of up to `PREFIX_MAX_SEQ` tokens.
- `cudnn`: cuDNN flash attention through `jax.nn.dot_product_attention` (GPU, bf16/fp16).
  Causality is cuDNN's own (the upper triangle is skipped); packed documents (and a
  sliding window) go in as a boolean [B, 1, S, S] same-segment mask, which JAX turns into
  one additive bias of the input dtype shared by all heads (2 * S^2 bytes per sequence:
  32 MiB at S = 4,096, against 4 * H * S^2 for the reference's scores). cuDNN's packed-sequence
  layout (segment offsets) would avoid it, but JAX exposes it only privately, wants a static
  maximum of documents per row, and scales key offsets by the query head count (suspect
  under grouped-query), so it is not used. In a backward pass JAX 0.10.2 also has cuDNN
  compute the bias's gradient (`should_export_dbias` is always true), which is dropped:
  a cost for the student's step to measure against blockwise on a GPU. No soft-capping.
  JAX's call has no sinks and wants values as wide as keys: a sink goes in as one more key,
  first in the row, that each query head scores at its sink logit (`_sink_as_key`; in
  bfloat16 to about 16 bits),
  and zero features widen the narrower of q/k and v; the row is padded to an even length
  (cuDNN's backward under a mask wants one). cuDNN itself handles both (JAX 0.10.2's
  private call accepts a value width of its own on Hopper), the public call does not.
  With `interpret=True` the same call runs JAX's XLA implementation (tests, off GPU).
- `splash`: the TPU Pallas splash kernel (`CausalMask`, or `LocalMask` for a window, and
  `SegmentIds`; its own soft-capping, sinks and value width). Its masks are static: a
  window must be a Python int, not per-layer scanned data. XLA cannot partition it: on rows
  sharded by a jitted program it runs per device under `jax.shard_map` (`over_rows`). With
  `interpret=True` it runs anywhere, slowly (used by the tests on CPU).
- `auto`: cudnn on a CUDA GPU for bf16/fp16 inputs, splash on TPU, prefix on CPU for rows
  up to `PREFIX_MAX_SEQ` tokens, blockwise elsewhere; never a backend that cannot run the
  model (`distill.config.model.backend_problem`: cudnn with soft-capping, splash with
  per-layer windows), blockwise instead.
"""

from __future__ import annotations

import contextlib
import math
import typing

import jax
import jax.numpy as jnp

from distill import collectives as cc
from distill.config import AttentionBackend
from distill.config.model import backend_problem
from distill.models.kernels.blockwise import Scores, blockwise, prefix, round_up, window_mask

BACKENDS = typing.get_args(AttentionBackend)
DEFAULT_BLOCK = 512  # splash's tiles, and blockwise's on accelerators
# Blockwise on CPU: small tiles keep each step's [B, KV, G, bq, bk] scores in cache. At
# B=16, 4 heads, S=256 the forward and backward took 15 and 44 ms with 64-row tiles
# against 17-34 and 71-73 ms with one 256-row tile; at S=1024, 64 was as fast as 256 and
# half the time of 512.
CPU_BLOCK = 64
# prefix: queries per block, and the longest rows `auto` gives it on CPU. At B=16, S=256,
# 4 heads, blocks of 32, 64 and 128 took 32, 32 and 41 ms forward and backward; at B=8,
# S=512, 53 ms against blockwise's 79 ms (PyTorch's SDPA: 39 ms).
PREFIX_BLOCK = 64
PREFIX_MAX_SEQ = 512


def attention(
    q_bshd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    segment_ids_bs: jax.Array,
    *,
    backend: str = "auto",
    scale: float | None = None,
    window: int | jax.Array | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Attention output [B, S, H, hd_v] in the dtype of `q_bshd`.

    q_bshd [B, S, H, hd] (RoPE applied), k_bskd [B, S, KV, hd], v_bskd [B, S, KV, hd_v] with
    H % KV == 0, segment_ids_bs [B, S] int. `scale` defaults to 1 / sqrt(hd). `window`: keys
    a query sees (itself included), a Python int or a traced int32 scalar (a layer's, under
    the layer scan); None: the whole causal prefix. `softcap`: cap of the scaled scores, or
    None. `sinks`: float32 [H] sink logits (this shard's query heads under tp), or None.
    `block_q` / `block_kv` are the blockwise and splash tile sizes (clipped to S; S is padded
    up to a multiple of them; default `DEFAULT_BLOCK`, or `CPU_BLOCK` for blockwise on CPU);
    `block_q` is also prefix's queries per block (default `PREFIX_BLOCK`). `interpret` runs
    splash in Pallas interpret mode (required off TPU), and makes cudnn's very call with JAX's own
    XLA implementation instead of cuDNN's (so our mask, scale and head layout are tested off
    GPU).
    """
    _check_shapes(q_bshd, k_bskd, v_bskd, segment_ids_bs, sinks)
    if scale is None:
        scale = 1.0 / math.sqrt(q_bshd.shape[-1])
    scale = float(scale)
    softcap = None if softcap is None else float(softcap)
    traced = window is not None and not isinstance(window, int)
    backend = resolve_backend(
        backend, q_bshd.dtype, q_bshd.shape[-1], q_bshd.shape[1],
        softcap=softcap is not None, mixed_windows=traced,
    )  # fmt: skip
    problem = backend_problem(backend, softcap is not None, traced)
    if problem:
        raise ValueError(f"attention backend {problem}")
    static_window = window if isinstance(window, int) else None  # splash's masks are static
    if window is not None:
        window = jnp.asarray(window, jnp.int32)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32)
    qkv = (q_bshd, k_bskd, v_bskd, segment_ids_bs)
    if backend == "reference":
        return _reference(*qkv, scale, window, softcap, sinks)
    if backend == "prefix":
        block = PREFIX_BLOCK if block_q is None else block_q
        return prefix(*qkv, Scores(scale, softcap), window, block, sinks)
    if backend == "cudnn":
        return _cudnn(*qkv, scale, window, sinks, interpret)
    cpu_tiles = backend == "blockwise" and platform() == "cpu"
    default = CPU_BLOCK if cpu_tiles else DEFAULT_BLOCK
    bq = default if block_q is None else block_q
    bk = default if block_kv is None else block_kv
    if backend == "blockwise":
        return blockwise(*qkv, Scores(scale, softcap), window, bq, bk, sinks=sinks)
    return _splash(*qkv, scale, static_window, softcap, sinks, bq, bk, interpret)


_platform: str | None = None  # set by `use_platform`; None: JAX's default backend


def use_platform(platform: str | None) -> None:
    """Choose backends and tiles for `platform` (cpu, gpu, tpu): the one this process's
    meshes are on (`distill.mesh.available_devices`). It differs from JAX's default backend
    when `mesh.platform` names another, say a plan on simulated CPU devices on a TPU host,
    whose programs must not use the TPU's splash kernel. None: the default backend."""
    global _platform
    _platform = platform


def platform() -> str:
    """The platform attention chooses for (`use_platform`, else JAX's default backend)."""
    return _platform or jax.default_backend()


def over_rows(backend: str, rows, **kw):
    """`attend(q, k, v, segment_ids, **kw)` for `backend` on activations whose rows are
    split as the NamedSharding `rows` says (None: unsharded), where XLA cannot split the
    backend's kernel itself: splash, a Mosaic kernel, which XLA's SPMD partitioner refuses
    ("Mosaic kernels cannot be automatically partitioned"), runs on each device's own rows
    under `jax.shard_map` (attention never mixes rows). None: `attention` as it is (every
    other backend, or one device). `kw`: more `attention` arguments (tests: interpret)."""
    if backend != "splash" or rows is None or rows.mesh.size == 1:
        return None
    spec = jax.P(rows.spec[0] if len(rows.spec) else None)

    def attend(q, k, v, segment_ids, sinks=None, **call):
        def local(q, k, v, segment_ids, sinks):
            return attention(q, k, v, segment_ids, backend=backend, sinks=sinks, **kw, **call)

        # no collectives to check; and splash's backward, traced outside `_splash`, would
        # meet the check its outputs fail (see `_splash`). The sinks, one per head, are on
        # every device (unchecked, shard_map sums their gradient over the devices).
        specs = (spec,) * 4 + (jax.P(),)
        run = jax.shard_map(local, mesh=rows.mesh, in_specs=specs, out_specs=spec, check_vma=False)
        return run(q, k, v, segment_ids, sinks)

    return attend


def resolve_backend(
    backend: str,
    dtype,
    head_dim: int,
    seq_len: int | None = None,
    *,
    softcap: bool = False,
    mixed_windows: bool = False,
) -> str:
    """The concrete backend `auto` stands for on this platform for rows of `seq_len` tokens
    (None: any length), for a model with soft-capped scores (`softcap`) or per-layer windows
    (`mixed_windows`); other backends pass through."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    if platform() == "tpu":
        return "blockwise" if backend_problem("splash", softcap, mixed_windows) else "splash"
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    cudnn_ok = not backend_problem("cudnn", softcap, mixed_windows)
    if _is_cuda() and half and head_dim % 8 == 0 and head_dim <= _cudnn_head_dim_max() and cudnn_ok:
        return "cudnn"
    if platform() == "cpu" and seq_len is not None and seq_len <= PREFIX_MAX_SEQ:
        return "prefix"
    return "blockwise"


def _cudnn_head_dim_max() -> int:
    """The widest head cuDNN's fused attention takes: 256 on Hopper (compute capability 9.0)
    and later, 128 before (JAX's own check, `check_is_flash_attention`): Qwen3.5's and
    Gemma's 256-wide heads and DeepSeek-V3's 192 run fused on an H100 or H200."""
    try:  # lowered for CUDA on a host without a GPU (`tests/test_lowering.py`): JAX's 128
        capability = getattr(jax.devices("gpu")[0], "compute_capability", None)
    except RuntimeError:
        return 128
    try:
        return 256 if capability is not None and float(capability) >= 9.0 else 128
    except ValueError:
        return 128


def _is_cuda() -> bool:
    if platform() != "gpu":
        return False
    return "cuda" in jax.devices("gpu")[0].client.platform_version.lower()


def _check_shapes(q, k, v, seg, sinks=None) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"attention wants q [B,S,H,hd], k [B,S,KV,hd] and v [B,S,KV,hd_v]; got {q.shape}, "
            f"{k.shape}, {v.shape}"
        )
    b, s, h, d = q.shape
    if k.shape[:2] != (b, s) or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(
            f"q {q.shape} and k/v {k.shape} disagree (query heads must be a multiple of "
            "key/value heads)"
        )
    if seg.shape != (b, s):
        raise ValueError(f"segment ids {seg.shape} should be [B, S] = {(b, s)}")
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"sinks {sinks.shape} should be one per query head: {(h,)}")


# --- reference ---------------------------------------------------------------------------


def _reference(q, k, v, seg, scale, window, softcap, sinks=None):
    """The plain math: [B, KV, G, S, S] float32 scores under a [B, 1, 1, S, S] mask; sinks
    as transformers' gpt_oss has them: a column joined to the scores, dropped after the
    softmax."""
    b, s, h, d = q.shape
    n_kv = k.shape[2]
    pos = jnp.arange(s)
    causal = window_mask(pos[:, None], pos[None, :], window)
    same_doc = seg[:, :, None] == seg[:, None, :]
    mask = (causal & same_doc)[:, None, None, :, :]
    q = q.reshape(b, s, n_kv, h // n_kv, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, Scores(scale, softcap)(scores), jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.reshape(1, n_kv, -1, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bkgst,btkd->bskgd", probs.astype(q.dtype), v)
    return out.reshape(b, s, h, v.shape[-1])


# --- cuDNN -------------------------------------------------------------------------------


def _cudnn(q, k, v, seg, scale, window, sinks, interpret):
    if not interpret and not _is_cuda():
        raise ValueError(
            f"attention backend 'cudnn' needs a CUDA GPU; this process runs on "
            f"{platform()!r} (use 'auto' or 'blockwise', or interpret=True to test)"
        )
    if not interpret and q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"attention backend 'cudnn' needs bfloat16 or float16 inputs, got {q.dtype} "
            "(set model dtype to bfloat16, or use 'auto' / 'blockwise')"
        )
    s, dv = q.shape[1], v.shape[-1]
    same_doc = seg[:, None, :, None] == seg[:, None, None, :]  # [B, 1, S, S], heads broadcast
    if window is not None:  # a traced per-layer window: part of the mask, not a static size
        pos = jnp.arange(s)
        same_doc = same_doc & (pos[:, None] - pos[None, :] < window)
    lead = 0 if sinks is None else 1  # the sink: one more position, first
    if sinks is not None:
        q, k, v, same_doc = _sink_as_key(q, k, v, same_doc, sinks, scale)
    if q.shape[1] % 2:  # cuDNN's backward under a mask wants an even length: one more last
        q, k, v = (jnp.pad(x, [(0, 0), (0, 1), (0, 0), (0, 0)]) for x in (q, k, v))
        same_doc = jnp.pad(same_doc, [(0, 0), (0, 0), (0, 1), (0, 1)]).at[..., -1, -1].set(True)
    # JAX wants values as wide as keys: zero features widen the narrower (and round the width
    # up to cuDNN's multiple of 8) without changing a score or an output feature
    width = round_up(max(q.shape[-1], dv), 8)
    q, k, v = (jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])]) for x in (q, k, v))
    o = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=same_doc,
        scale=scale,
        is_causal=True,
        implementation="xla" if interpret else "cudnn",
    )
    return o[:, lead : lead + s, :, :dv]


def _sink_as_key(q, k, v, mask, sinks, scale):
    """Sinks for a kernel without them, exactly: one more key first in every row, which
    each query head scores at its own sink logit, with a zero value. Each head's features
    gain 2G columns (G query heads a key/value head) holding a one-hot of its place g in
    its group, twice; the sink key of a key/value head holds its group's logits / scale
    there, once rounded to q's dtype and once the remainder (so that bfloat16 keeps them to
    about 16 bits), the real keys zeros. A leading query of zeros, dropped after, keeps the
    causal diagonal aligned; the mask lets every query see the sink, and the gradient of
    the sinks flows back through the sink key. Returns q [B, S+1, H, hd+2G], k likewise,
    v [B, S+1, KV, hd_v] and the mask [B, 1, S+1, S+1]."""
    b, s, h, d = q.shape
    n_kv, dt = k.shape[2], q.dtype
    g = h // n_kv
    logit = sinks.reshape(n_kv, g) / scale
    hi = logit.astype(dt)
    lo = (logit - hi.astype(jnp.float32)).astype(dt)
    place = jnp.tile(jnp.eye(g, dtype=dt), (n_kv, 1))  # [H, G]: head kv * G + g -> e_g
    q = jnp.concatenate([q, jnp.broadcast_to(jnp.tile(place, 2), (b, s, h, 2 * g))], axis=-1)
    k = jnp.concatenate([k, jnp.zeros((b, s, n_kv, 2 * g), dt)], axis=-1)
    sink_k = jnp.concatenate([jnp.zeros((n_kv, d), dt), hi, lo], axis=-1)
    q = jnp.concatenate([jnp.zeros((b, 1, h, d + 2 * g), dt), q], axis=1)
    k = jnp.concatenate([jnp.broadcast_to(sink_k, (b, 1, n_kv, d + 2 * g)), k], axis=1)
    v = jnp.concatenate([jnp.zeros((b, 1, n_kv, v.shape[-1]), v.dtype), v], axis=1)
    mask = jnp.pad(mask, [(0, 0), (0, 0), (1, 0), (1, 0)]).at[:, :, :, 0].set(True)
    return q, k, v, mask


# --- splash (TPU Pallas) -----------------------------------------------------------------


def _splash(q, k, v, seg, scale, window, softcap, sinks, block_q, block_kv, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )

    if not interpret and platform() != "tpu":
        raise ValueError(
            f"attention backend 'splash' is a TPU kernel; this process runs on "
            f"{platform()!r} (use 'auto' or 'blockwise', or interpret=True to test)"
        )
    lane = 128  # splash tiles are whole multiples of the TPU lane width
    if block_q % lane or block_kv % lane:
        raise ValueError(f"splash block sizes must be multiples of {lane}: {block_q}, {block_kv}")
    b, s, h, d = q.shape
    s_lanes = round_up(s, lane)
    bq, bk = min(block_q, s_lanes), min(block_kv, s_lanes)
    sp = round_up(s, math.lcm(bq, bk))
    kernel = _splash_kernel(h, sp, bq, bk, window, softcap, interpret)
    # splash has no scale argument: scale q (in float32) before it goes in.
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    pad = [(0, 0), (0, sp - s), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, heads, S, d]
    seg = jnp.pad(seg, [(0, 0), (0, sp - s)])

    def one_row(q, k, v, seg, sinks):  # the kernel's own sinks, and values of their width
        return kernel(q, k, v, segment_ids=splash.SegmentIds(q=seg, kv=seg), sinks=sinks)

    # JAX 0.10's splash kernel declares its outputs without the mesh axes they vary over,
    # which `jax.shard_map`'s check (the teacher's forward) refuses: traced without the
    # check, its output is then marked varying as q is (each device's own rows).
    vma = cc.varying(q)
    with _unchecked_vma():
        o = jax.vmap(one_row, in_axes=(0, 0, 0, 0, None))(q, k, v, seg, sinks)
    return cc.vary(o, vma).transpose(0, 2, 1, 3)[:, :s]


def _unchecked_vma():
    """JAX's private switch for one call's check (no public one); where a JAX release has
    it no more, the call runs as it is."""
    from jax._src import config as jax_config

    switch = getattr(jax_config, "_check_vma", None)
    return contextlib.nullcontext() if switch is None else switch(False)


def _splash_kernel(n_heads, seq, bq, bk, window, softcap, interpret):
    """Built per trace: the kernel holds its block-sparsity tables as arrays of that trace.
    A window is a `LocalMask` reaching window - 1 keys back and none ahead (causal)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    if window is None:
        one = masks.CausalMask((seq, seq))
    else:
        one = masks.LocalMask((seq, seq), window_size=(window - 1, 0), offset=0)
    mask = masks.MultiHeadMask([one for _ in range(n_heads)])
    sizes = splash.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    return splash.make_splash_mha(
        mask,
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=softcap,
        interpret=interpret,
    )
