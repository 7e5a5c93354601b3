"""Causal, segment-aware, grouped-query attention, with backends that never form S x S.

One entry point, `attention(q, k, v, segment_ids, backend=...)`, for both roles. A token
attends to earlier tokens (itself included) of the same packed document: same segment id,
causal. Segment id 0 marks padding; it is treated like any other id, so a padding row
attends to the padding before it and is never all-masked (no NaN). Heads are grouped-query:
query head h reads key/value head h // G (G = H / KV), the order of
`q.reshape(B, S, KV, G, hd)`. Sizes are read off the arrays, so under tensor parallelism the
heads are this shard's local heads.

Backends:

- `reference`: the plain math (float32 [B, KV, G, S, S] scores, softmax): the test oracle.
- `blockwise`: flash-style XLA for any platform. An online softmax over key/value blocks
  for each query block, float32 scores, normaliser and output, and a `jax.custom_vjp`
  whose backward recomputes each block's scores from (q, k, v, o, logsumexp). Key blocks
  entirely above the causal diagonal are never visited. What is live is a few
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
  Causality is cuDNN's own (the upper triangle is skipped); packed documents go in as a
  boolean [B, 1, S, S] same-segment mask, which JAX turns into one additive bias of the
  input dtype shared by all heads (2 * S^2 bytes per sequence: 32 MiB at S = 4,096,
  against 4 * H * S^2 for the reference's scores). cuDNN's packed-sequence layout
  (segment offsets) would avoid it, but JAX exposes it only privately, wants a static
  maximum of documents per row, and scales key offsets by the query head count (suspect
  under grouped-query), so it is not used. In a backward pass JAX 0.10.2 also has cuDNN
  compute the bias's gradient (`should_export_dbias` is always true), which is dropped:
  a cost for the student's step to measure against blockwise on a GPU.
  With `interpret=True` the same call runs JAX's XLA implementation (tests, off GPU).
- `splash`: the TPU Pallas splash kernel (`CausalMask` and `SegmentIds`); with
  `interpret=True` it runs anywhere, slowly (used by the tests on CPU).
- `auto`: cudnn on a CUDA GPU for bf16/fp16 inputs, splash on TPU, prefix on CPU for rows
  up to `PREFIX_MAX_SEQ` tokens, blockwise elsewhere.
"""

from __future__ import annotations

import functools
import math
import typing

import jax
import jax.numpy as jnp
from jax import lax

from distill.config import AttentionBackend

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
# Finite, so an all-masked block gives exp(0) (then zeroed) rather than exp(-inf + inf) = NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention(
    q_bshd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    segment_ids_bs: jax.Array,
    *,
    backend: str = "auto",
    scale: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Attention output [B, S, H, hd] in the dtype of `q_bshd`.

    q_bshd [B, S, H, hd] (RoPE applied), k_bskd / v_bskd [B, S, KV, hd] with H % KV == 0,
    segment_ids_bs [B, S] int. `scale` defaults to 1 / sqrt(hd). `block_q` / `block_kv` are
    the blockwise and splash tile sizes (clipped to S; S is padded up to a multiple of
    them; default `DEFAULT_BLOCK`, or `CPU_BLOCK` for blockwise on CPU); `block_q` is also
    prefix's queries per block (default `PREFIX_BLOCK`). `interpret` runs splash in Pallas
    interpret mode (required off TPU), and makes cudnn's very call with JAX's own XLA
    implementation instead of cuDNN's (so our mask, scale and head layout are tested off GPU).
    """
    _check_shapes(q_bshd, k_bskd, v_bskd, segment_ids_bs)
    if scale is None:
        scale = 1.0 / math.sqrt(q_bshd.shape[-1])
    scale = float(scale)
    backend = resolve_backend(backend, q_bshd.dtype, q_bshd.shape[-1], q_bshd.shape[1])
    if backend == "reference":
        return _reference(q_bshd, k_bskd, v_bskd, segment_ids_bs, scale)
    if backend == "prefix":
        block = PREFIX_BLOCK if block_q is None else block_q
        return _prefix(q_bshd, k_bskd, v_bskd, segment_ids_bs, scale, block)
    if backend == "cudnn":
        return _cudnn(q_bshd, k_bskd, v_bskd, segment_ids_bs, scale, interpret)
    cpu_tiles = backend == "blockwise" and platform() == "cpu"
    default = CPU_BLOCK if cpu_tiles else DEFAULT_BLOCK
    bq = default if block_q is None else block_q
    bk = default if block_kv is None else block_kv
    if backend == "blockwise":
        return _blockwise(q_bshd, k_bskd, v_bskd, segment_ids_bs, scale, bq, bk)
    return _splash(q_bshd, k_bskd, v_bskd, segment_ids_bs, scale, bq, bk, interpret)


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


def resolve_backend(backend: str, dtype, head_dim: int, seq_len: int | None = None) -> str:
    """The concrete backend `auto` stands for on this platform for rows of `seq_len` tokens
    (None: any length); other backends pass through."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    if platform() == "tpu":
        return "splash"
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if _is_cuda() and half and head_dim % 8 == 0 and head_dim <= 128:
        return "cudnn"
    if platform() == "cpu" and seq_len is not None and seq_len <= PREFIX_MAX_SEQ:
        return "prefix"
    return "blockwise"


def _is_cuda() -> bool:
    if platform() != "gpu":
        return False
    return "cuda" in jax.devices("gpu")[0].client.platform_version.lower()


def _check_shapes(q, k, v, seg) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"attention wants q [B,S,H,hd], k and v [B,S,KV,hd]; got {q.shape}, {k.shape}, "
            f"{v.shape}"
        )
    b, s, h, d = q.shape
    if k.shape[:2] != (b, s) or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(
            f"q {q.shape} and k/v {k.shape} disagree (query heads must be a multiple of "
            "key/value heads)"
        )
    if seg.shape != (b, s):
        raise ValueError(f"segment ids {seg.shape} should be [B, S] = {(b, s)}")


# --- reference ---------------------------------------------------------------------------


def _reference(q, k, v, seg, scale):
    """The plain math: [B, KV, G, S, S] float32 scores under a [B, 1, 1, S, S] mask."""
    b, s, h, d = q.shape
    n_kv = k.shape[2]
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    same_doc = seg[:, :, None] == seg[:, None, :]
    mask = (causal & same_doc)[:, None, None, :, :]
    q = q.reshape(b, s, n_kv, h // n_kv, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, h, d)


# --- blockwise ---------------------------------------------------------------------------


def _blockwise(q, k, v, seg, scale, block_q, block_kv):
    """Pad S to whole blocks, lay the arrays out block-major, run the flash kernel."""
    if block_q < 1 or block_kv < 1:
        raise ValueError(f"block sizes must be positive, got {block_q}, {block_kv}")
    b, s, h, d = q.shape
    n_kv = k.shape[2]
    g = h // n_kv
    bq, bk = min(block_q, s), min(block_kv, s)
    sp = _round_up(s, math.lcm(bq, bk))
    nq, nk = sp // bq, sp // bk
    # Padding sits after every real token, so causality alone keeps it out of real rows;
    # padded rows attend to themselves (finite) and are sliced off.
    pad = [(0, 0), (0, sp - s), (0, 0), (0, 0)]
    q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    seg = jnp.pad(seg, [(0, 0), (0, sp - s)])
    qb = q.reshape(b, nq, bq, n_kv, g, d).transpose(1, 0, 3, 4, 2, 5)  # [nq, B, KV, G, bq, d]
    kb = k.reshape(b, nk, bk, n_kv, d).transpose(1, 0, 3, 2, 4)  # [nk, B, KV, bk, d]
    vb = v.reshape(b, nk, bk, n_kv, d).transpose(1, 0, 3, 2, 4)
    seg_q = seg.reshape(b, nq, bq).transpose(1, 0, 2)  # [nq, B, bq]
    seg_k = seg.reshape(b, nk, bk).transpose(1, 0, 2)  # [nk, B, bk]
    ob = _flash(qb, kb, vb, seg_q, seg_k, scale)
    o = ob.transpose(1, 0, 4, 2, 3, 5).reshape(b, sp, h, d)
    return o[:, :s]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _block_mask(i, j, seg_q_i, seg_k_j, bq: int, bk: int):
    """[B, 1, 1, bq, bk]: causal and same segment, for query block i against key block j."""
    q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    same_doc = seg_q_i[:, :, None] == seg_k_j[:, None, :]
    return (same_doc & (q_pos >= k_pos))[:, None, None]


def _flash_forward(qb, kb, vb, seg_q, seg_k, scale):
    """Blocked output [nq, B, KV, G, bq, d] and its logsumexp [nq, B, KV, G, bq] (float32)."""
    nq, b, n_kv, g, bq, d = qb.shape
    bk = kb.shape[3]

    def query_block(_, xs):
        i, q_i, seg_q_i = xs

        def key_block(j, carry):
            m, denom, acc = carry
            s = jnp.einsum("bkgqd,bksd->bkgqs", q_i, kb[j], preferred_element_type=jnp.float32)
            mask = _block_mask(i, j, seg_q_i, seg_k[j], bq, bk)
            s = jnp.where(mask, s * scale, _MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum(
                "bkgqs,bksd->bkgqd", p.astype(vb.dtype), vb[j], preferred_element_type=jnp.float32
            )
            return m_new, denom * alpha + p.sum(axis=-1), acc * alpha[..., None] + pv

        # carries made from q_i, so that under `shard_map` they vary over the same mesh
        # axes as q (a fresh constant would not, and fori_loop needs equal carry types)
        init = (
            jnp.full_like(q_i[..., 0], _MASK_VALUE, jnp.float32),
            jnp.zeros_like(q_i[..., 0], jnp.float32),
            jnp.zeros_like(q_i, jnp.float32),
        )
        last = ((i + 1) * bq - 1) // bk  # key blocks past this one lie above the diagonal
        m, denom, acc = lax.fori_loop(0, last + 1, key_block, init)
        return None, ((acc / denom[..., None]).astype(qb.dtype), m + jnp.log(denom))

    _, (ob, lse) = lax.scan(query_block, None, (jnp.arange(nq), qb, seg_q))
    return ob, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(qb, kb, vb, seg_q, seg_k, scale):
    return _flash_forward(qb, kb, vb, seg_q, seg_k, scale)[0]


def _flash_fwd(qb, kb, vb, seg_q, seg_k, scale):
    ob, lse = _flash_forward(qb, kb, vb, seg_q, seg_k, scale)
    return ob, (qb, kb, vb, seg_q, seg_k, ob, lse)


def _flash_bwd(scale, res, do_b):
    """FlashAttention-2 backward: per key block, visit the query blocks at or below the
    diagonal, recompute p from the saved logsumexp, accumulate dk/dv there and dq in place."""
    qb, kb, vb, seg_q, seg_k, ob, lse = res
    nq, _, _, _, bq, _ = qb.shape
    nk, bk = kb.shape[0], kb.shape[3]
    delta = jnp.sum(do_b.astype(jnp.float32) * ob.astype(jnp.float32), axis=-1)

    def key_block(dq, xs):
        j, k_j, v_j, seg_k_j = xs

        def query_block(i, carry):
            dq, dk_j, dv_j = carry
            q_i, do_i = qb[i], do_b[i]
            s = jnp.einsum("bkgqd,bksd->bkgqs", q_i, k_j, preferred_element_type=jnp.float32)
            mask = _block_mask(i, j, seg_q[i], seg_k_j, bq, bk)
            p = jnp.where(mask, jnp.exp(s * scale - lse[i][..., None]), 0.0)
            dv_j = dv_j + jnp.einsum(
                "bkgqs,bkgqd->bksd", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bkgqd,bksd->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta[i][..., None]) * scale).astype(qb.dtype)
            dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds, k_j, preferred_element_type=jnp.float32)
            dk_j = dk_j + jnp.einsum(
                "bkgqs,bkgqd->bksd", ds, q_i, preferred_element_type=jnp.float32
            )
            return dq.at[i].add(dq_i), dk_j, dv_j

        zeros = jnp.zeros_like(k_j, jnp.float32)  # varying like k_j under shard_map
        first = (j * bk) // bq  # query blocks before this one lie above the diagonal
        dq, dk_j, dv_j = lax.fori_loop(first, nq, query_block, (dq, zeros, zeros))
        return dq, (dk_j.astype(kb.dtype), dv_j.astype(vb.dtype))

    dq0 = jnp.zeros_like(qb, jnp.float32)
    dq, (dkb, dvb) = lax.scan(key_block, dq0, (jnp.arange(nk), kb, vb, seg_k))
    return dq.astype(qb.dtype), dkb, dvb, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# --- prefix ------------------------------------------------------------------------------


def _prefix(q, k, v, seg, scale, block):
    """Head-major copies [B, KV, G, S, d] and [B, KV, S, d], the blocks, and back."""
    if block < 1:
        raise ValueError(f"block size must be positive, got {block}")
    b, s, h, d = q.shape
    n_kv = k.shape[2]
    qh = q.reshape(b, s, n_kv, h // n_kv, d).transpose(0, 2, 3, 1, 4)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    o = _prefix_blocks(qh, kh, vh, seg, scale, min(block, s))
    return o.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)


def _prefix_spans(s: int, block: int) -> list[tuple[int, int]]:
    """(start, end) of each query block; the last may be shorter."""
    return [(i, min(i + block, s)) for i in range(0, s, block)]


def _prefix_scores(qh, kh, seg, scale, start: int, end: int):
    """Scaled scores [B, KV, G, end - start, end] of queries start:end against keys :end,
    and their mask (causal, same segment)."""
    s = jnp.einsum(
        "bkgqd,bktd->bkgqt", qh[:, :, :, start:end], kh[:, :, :end],
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    q_pos = start + lax.broadcasted_iota(jnp.int32, (end - start, end), 0)
    k_pos = lax.broadcasted_iota(jnp.int32, (end - start, end), 1)
    same_doc = seg[:, start:end, None] == seg[:, None, :end]
    return s * scale, (same_doc & (q_pos >= k_pos))[:, None, None]


def _prefix_forward(qh, kh, vh, seg, scale, block):
    """Output [B, KV, G, S, d] and its logsumexp [B, KV, G, S] (float32)."""
    outs, lses = [], []
    for start, end in _prefix_spans(qh.shape[3], block):
        s, mask = _prefix_scores(qh, kh, seg, scale, start, end)
        s = jnp.where(mask, s, _MASK_VALUE)
        m = s.max(axis=-1, keepdims=True)
        p = jnp.exp(s - m)  # masked entries underflow to 0: each row sees itself
        denom = p.sum(axis=-1, keepdims=True)
        pv = jnp.einsum(
            "bkgqt,bktd->bkgqd", p.astype(vh.dtype), vh[:, :, :end],
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        outs.append((pv / denom).astype(qh.dtype))
        lses.append((m + jnp.log(denom))[..., 0])
    return jnp.concatenate(outs, axis=3), jnp.concatenate(lses, axis=3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _prefix_blocks(qh, kh, vh, seg, scale, block):
    return _prefix_forward(qh, kh, vh, seg, scale, block)[0]


def _prefix_fwd(qh, kh, vh, seg, scale, block):
    o, lse = _prefix_forward(qh, kh, vh, seg, scale, block)
    return o, (qh, kh, vh, seg, o, lse)


def _prefix_bwd(scale, block, res, do):
    """Per query block: p from the saved logsumexp, then dq for the block and its share of
    dk, dv for the keys it saw (added into the whole)."""
    qh, kh, vh, seg, o, lse = res
    s_len = qh.shape[3]
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    dqs, dk, dv = [], 0.0, 0.0
    for start, end in _prefix_spans(s_len, block):
        q_i, do_i = qh[:, :, :, start:end], do[:, :, :, start:end]
        s, mask = _prefix_scores(qh, kh, seg, scale, start, end)
        p = jnp.where(mask, jnp.exp(s - lse[:, :, :, start:end, None]), 0.0)
        f32 = jnp.float32
        dv_i = jnp.einsum("bkgqt,bkgqd->bktd", p.astype(do.dtype), do_i, preferred_element_type=f32)
        dp = jnp.einsum("bkgqd,bktd->bkgqt", do_i, vh[:, :, :end], preferred_element_type=f32)
        ds = (p * (dp - delta[:, :, :, start:end, None]) * scale).astype(qh.dtype)
        dqs.append(jnp.einsum("bkgqt,bktd->bkgqd", ds, kh[:, :, :end], preferred_element_type=f32))
        dk_i = jnp.einsum("bkgqt,bkgqd->bktd", ds, q_i, preferred_element_type=f32)
        pad = [(0, 0), (0, 0), (0, s_len - end), (0, 0)]
        dk, dv = dk + jnp.pad(dk_i, pad), dv + jnp.pad(dv_i, pad)
    dq = jnp.concatenate(dqs, axis=3)
    return dq.astype(qh.dtype), dk.astype(kh.dtype), dv.astype(vh.dtype), None


_prefix_blocks.defvjp(_prefix_fwd, _prefix_bwd)


# --- cuDNN -------------------------------------------------------------------------------


def _cudnn(q, k, v, seg, scale, interpret):
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
    same_doc = seg[:, None, :, None] == seg[:, None, None, :]  # [B, 1, S, S], heads broadcast
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=same_doc,
        scale=scale,
        is_causal=True,
        implementation="xla" if interpret else "cudnn",
    )


# --- splash (TPU Pallas) -----------------------------------------------------------------


def _splash(q, k, v, seg, scale, block_q, block_kv, interpret):
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
    s_lanes = _round_up(s, lane)
    bq, bk = min(block_q, s_lanes), min(block_kv, s_lanes)
    sp = _round_up(s, math.lcm(bq, bk))
    kernel = _splash_kernel(h, sp, bq, bk, interpret)
    # splash has no scale argument: scale q (in float32) before it goes in.
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    pad = [(0, 0), (0, sp - s), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, heads, S, d]
    seg = jnp.pad(seg, [(0, 0), (0, sp - s)])

    def one_row(q, k, v, seg):
        return kernel(q, k, v, segment_ids=splash.SegmentIds(q=seg, kv=seg))

    o = jax.vmap(one_row)(q, k, v, seg)
    return o.transpose(0, 2, 1, 3)[:, :s]


def _splash_kernel(n_heads: int, seq: int, bq: int, bk: int, interpret: bool):
    """Built per trace: the kernel holds its block-sparsity tables as arrays of that trace."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    mask = masks.MultiHeadMask([masks.CausalMask((seq, seq)) for _ in range(n_heads)])
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
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )
