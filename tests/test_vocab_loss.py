"""Chunked losses from hidden states (distill.models.vocab_loss) against the whole-logits losses of
distill.models.losses on x @ head: values and gradients, padded vocabularies, bfloat16 compute, and
the compiled program's memory at real sizes (compile only)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill.collectives import mask_vocab
from distill.config import DistillLossConfig
from distill.models import losses
from distill.models.losses import PADDED_LOGIT
from distill.models.vocab_loss import (
    ce_loss_chunked,
    default_chunk,
    eval_metrics_chunked,
    head_logits,
    kd_loss_chunked,
)
from distill.types import TeacherOutput

# A padded model vocabulary (V) over a smaller tokenizer's (LIVE). S = 7 positions in chunks
# of 3: the last chunk is shifted back to overlap the one before.
B, S, D, V, LIVE = 2, 7, 16, 40, 33
CHUNK = 3
T = 2.0
LOSSES = ["forward_kl", "reverse_kl", "jsd"]
ALPHAS = (0.0, 0.5, 1.0)
TEACHERS = {"dense": None, "topk": 5, "topk_live": LIVE}

# Tests compile many small programs and run each once: skip the backend's optimisations.
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def make_inputs(seed, s=S, logit_scale=3.0):
    """Hidden states and a head whose logits have std ~logit_scale; a teacher whose padded
    ids are -inf (as the teacher masks them); live targets; a mask with zeros."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, s, D)).astype(np.float32)
    head = (rng.normal(size=(D, V)) * logit_scale / np.sqrt(D)).astype(np.float32)
    teacher_z = (rng.normal(size=(B, s, V)) * logit_scale).astype(np.float32)
    teacher_z[..., LIVE:] = -np.inf
    targets = rng.integers(0, LIVE, size=(B, s)).astype(np.int32)
    mask = np.ones((B, s), np.float32)
    mask[0, 2] = mask[1, 0] = mask[1, s - 1] = 0.0
    return x, head, teacher_z, targets, mask


def teacher_of(teacher_z, k):
    lp = jax.nn.log_softmax(jnp.asarray(teacher_z) / T, axis=-1)
    if k is None:
        return TeacherOutput(lp)
    ids = jnp.argsort(-lp, axis=-1)[..., :k].astype(jnp.int32)
    return TeacherOutput(jnp.take_along_axis(lp, ids, axis=-1), ids)


def whole_logits(x, head, vocab_limit=LIVE):
    """The reference: the whole [B, S, V] float32 logits, padded ids masked as the student."""
    z = jnp.einsum("bsd,dv->bsv", x, head, precision=jax.lax.Precision.HIGHEST)
    return mask_vocab(z, vocab_limit, None, fill=PADDED_LOGIT)


def assert_close(got, want, rtol=1e-5, err_msg=""):
    """Elementwise within rtol of the larger of |want| and a tenth of want's largest value."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), err_msg
    scale = np.maximum(np.abs(want), 0.1 * np.abs(want).max() + 1e-12)
    assert (np.abs(got - want) <= rtol * scale).all(), (err_msg, np.abs(got - want).max())


def cfg_with_traced_alpha(loss, alpha):
    """A config whose alpha is traced (model_construct skips validation), so one compilation
    under `jax.vmap` covers every alpha."""
    return DistillLossConfig.model_construct(loss=loss, temperature=T, alpha=alpha, beta=0.3)


@pytest.mark.parametrize("kind", ["dense", "topk", "topk_live"])
@pytest.mark.parametrize("loss", LOSSES)
def test_kd_chunked_matches_whole(loss, kind):
    x, head, teacher_z, targets, mask = make_inputs(seed=len(loss) + len(kind))
    teacher, dense = teacher_of(teacher_z, TEACHERS[kind]), teacher_of(teacher_z, None)

    def run(alpha):
        cfg = cfg_with_traced_alpha(loss, alpha)
        whole = lambda x, head, teacher=teacher: losses.kd_loss(
            whole_logits(x, head), teacher, targets, mask, cfg, vocab_limit=LIVE
        )
        chunked = lambda x, head: kd_loss_chunked(
            x, head, teacher, targets, mask, cfg, vocab_limit=LIVE, chunk=CHUNK
        )
        grad = lambda f: jax.value_and_grad(f, (0, 1), has_aux=True)(x, head)
        return grad(whole), grad(chunked), whole(x, head, dense)[1]["kd_loss"]

    out = fast_jit(jax.vmap(run))(jnp.array(ALPHAS))
    ((_, want), want_grads), ((_, got), got_grads), dense_kd = out
    assert set(got) == set(want)
    for key in want:
        assert_close(got[key], want[key], err_msg=key)
    for name, g, w in zip(("x", "head"), got_grads, want_grads, strict=True):
        for alpha, g_a, w_a in zip(ALPHAS, g, w, strict=True):
            assert_close(g_a, w_a, rtol=2e-5, err_msg=f"alpha={alpha} d{name}")
    if kind == "topk_live":  # every live id in the top-k: the dense divergence, not ~1e22
        assert_close(got["kd_loss"], dense_kd, rtol=1e-5)


def test_topk_at_or_above_live_vocab_is_dense():
    """Every live id in the top-k (k = LIVE, or more on the padded vocabulary): the tail is
    all padding and the result is the dense divergence over the live ids, NaN-free. Without
    vocab_limit the whole-logits loss cannot know that: its forward KL is ~1e22 (a teacher
    tail floored at TAIL_FLOOR against the student's tail of padded ids at -1e30)."""
    x, head, teacher_z, targets, mask = make_inputs(seed=1)
    dense, live, above = (teacher_of(teacher_z, k) for k in (None, LIVE, LIVE + 3))

    def run(x, head):
        out = {}
        for loss in LOSSES:
            cfg = DistillLossConfig(loss=loss, temperature=T, alpha=1.0, beta=0.3)
            kd = lambda t, limit=LIVE, cfg=cfg: losses.kd_loss(
                whole_logits(x, head), t, targets, mask, cfg, vocab_limit=limit
            )[1]["kd_loss"]
            f = lambda x, head, cfg=cfg: kd_loss_chunked(
                x, head, above, targets, mask, cfg, vocab_limit=LIVE, chunk=CHUNK
            )
            (_, metrics), grads = jax.value_and_grad(f, (0, 1), has_aux=True)(x, head)
            out[loss] = kd(dense), kd(live, None), kd(live), kd(above), metrics["kd_loss"], grads
        return out

    for loss, (dense_kd, blind, *kds, grads) in fast_jit(run)(x, head).items():
        assert loss != "forward_kl" or float(blind) > 1e15
        for kd in kds:
            assert_close(kd, dense_kd, rtol=1e-5, err_msg=loss)
        assert all(np.isfinite(g).all() for g in grads), loss


def test_ce_chunked_matches_whole():
    x, head, _, targets, mask = make_inputs(seed=3, s=8)  # chunks of 4 divide S: no shift

    @fast_jit
    def run(x, head):
        grad = lambda f: jax.value_and_grad(f, (0, 1), has_aux=True)(x, head)
        whole = lambda x, head: losses.ce_loss(whole_logits(x, head, None), targets, mask)
        chunked = lambda x, head: ce_loss_chunked(x, head, targets, mask, vocab_limit=None, chunk=4)
        return grad(whole), grad(chunked)

    ((_, want), want_grads), ((_, got), got_grads) = run(x, head)
    assert set(got) == set(want)
    for key in want:
        assert_close(got[key], want[key], err_msg=key)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert_close(g, w, rtol=2e-5)


def test_eval_metrics_chunked_matches_whole():
    x, head, teacher_z, targets, mask = make_inputs(seed=4)
    x[0, 0] = x[0, 1]  # two equal positions; and make some argmaxes agree
    teacher_z[1, 1:4, :LIVE] = np.asarray(whole_logits(x, head))[1, 1:4, :LIVE]
    want = losses.eval_metrics(whole_logits(x, head), teacher_z, targets, mask)
    got = fast_jit(
        lambda x, head, t: eval_metrics_chunked(
            x, head, t, targets, mask, vocab_limit=LIVE, chunk=CHUNK
        )
    )(x, head, teacher_z)
    assert set(got) == set(want) and float(want["top1_agreement"]) > 0
    for key in want:
        assert_close(got[key], want[key], err_msg=key)


def test_empty_mask_gives_zero():
    x, head, teacher_z, targets, mask = make_inputs(seed=5)
    cfg = DistillLossConfig(loss="jsd", temperature=T, alpha=0.5)
    zero = np.zeros_like(mask)
    loss, metrics = fast_jit(
        lambda x, head: kd_loss_chunked(
            x, head, teacher_of(teacher_z, 5), targets, zero, cfg, vocab_limit=LIVE, chunk=CHUNK
        )
    )(x, head)
    assert float(loss) == 0.0 and float(metrics["tokens"]) == 0.0


def test_logits_accumulate_in_float32():
    """bfloat16 operands, float32 products and sums: never rounded through bfloat16."""
    x, head, *_ = make_inputs(seed=6, logit_scale=7.0)
    got = head_logits(x, head, vocab_limit=None, compute_dtype=jnp.bfloat16)
    up = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)
    exact = np.einsum("bsd,dv->bsv", up(x), up(head))  # the float64 product of bf16 operands
    rounded = up(exact)  # what `x @ head.astype(bf16)` returns, cast back
    assert got.dtype == jnp.float32
    assert np.abs(got - exact).max() < 1e-4
    assert np.abs(rounded - exact).max() > 100 * np.abs(got - exact).max()


def test_bfloat16_compute_close_to_float32():
    """Logits of realistic magnitude (std 7, spanning about +-20): the bfloat16 operands'
    rounding moves the loss by 6e-4 relative and the gradients by 6e-3 (L2, relative), as
    measured; tolerances 3e-3 and 3e-2."""
    x, head, _, targets, mask = make_inputs(seed=7, logit_scale=7.0)
    rng = np.random.default_rng(8)
    teacher_z = np.asarray(whole_logits(x, head)) + rng.normal(size=(B, S, V)) * 2.0
    teacher_z[..., LIVE:] = -np.inf
    cfg = DistillLossConfig(loss="forward_kl", temperature=T, alpha=0.5)
    teacher = teacher_of(teacher_z, 8)

    @fast_jit
    def run(x, head):
        out = {}
        for dt in (jnp.float32, jnp.bfloat16):
            f = lambda x, head, dt=dt: kd_loss_chunked(
                x,
                head,
                teacher,
                targets,
                mask,
                cfg,
                vocab_limit=LIVE,
                chunk=CHUNK,
                compute_dtype=dt,
            )
            out[jnp.dtype(dt).name] = jax.value_and_grad(f, (0, 1), has_aux=True)(x, head)
        return out

    out = run(x, head)
    assert np.abs(np.asarray(whole_logits(x, head))[..., :LIVE]).max() > 15
    ((lo, _), lo_grads), ((hi, _), hi_grads) = out["bfloat16"], out["float32"]
    assert abs(float(lo) - float(hi)) <= 3e-3 * abs(float(hi))
    for g, w in zip(lo_grads, hi_grads, strict=True):
        assert g.dtype == jnp.float32
        assert np.linalg.norm(g - w) <= 3e-2 * np.linalg.norm(w)


def test_batch_split_over_devices_matches_one_device():
    """A chunk spans every row, so a batch split over `dp` stays split: same result, and the
    compiled program gathers nothing (the dense teacher is read in place on each device)."""
    devices = np.array(jax.devices()[:8])
    mesh = jax.sharding.Mesh(devices, ("dp",))
    b = len(devices)
    rng = np.random.default_rng(9)
    x = rng.normal(size=(b, S, D)).astype(np.float32)
    head = (rng.normal(size=(D, V)) * 3.0 / np.sqrt(D)).astype(np.float32)
    lp = np.asarray(jax.nn.log_softmax(rng.normal(size=(b, S, V)) * 3.0, axis=-1), np.float32)
    targets = rng.integers(0, V, size=(b, S)).astype(np.int32)
    mask = np.ones((b, S), np.float32)
    cfg = DistillLossConfig(loss="jsd", temperature=T, alpha=0.5)

    def f(x, head, lp, targets, mask):
        loss = lambda x, head: kd_loss_chunked(
            x, head, TeacherOutput(lp), targets, mask, cfg, chunk=CHUNK
        )[0]
        return jax.value_and_grad(loss, (0, 1))(x, head)

    split, whole = NamedSharding(mesh, P("dp")), NamedSharding(mesh, P())
    sharded = fast_jit(f, in_shardings=(split, whole, split, split, split))
    args = (x, head, lp, targets, mask)
    assert "all-gather" not in sharded.lower(*args).compile().as_text()
    (got, got_grads), (want, want_grads) = sharded(*args), fast_jit(f)(*args)
    assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert_close(g, w, rtol=2e-5)


def test_default_chunk_bounds_one_chunk_of_logits():
    assert default_chunk(131072) == 512  # 512 x 128k float32 = 256 MiB
    assert default_chunk(32768) == 2048
    assert default_chunk(131072, rows=16) == 32
    assert default_chunk(50257) == 1024  # rounded down to a power of two
    assert default_chunk(10**9) == 1


def _temp_bytes(fn, vocab, tokens=4096, d=2048):
    """Compile only: temporary bytes of grad(fn) wrt (x, head) at B = 1, S = tokens, with a
    dense teacher and the last 64 ids padding."""
    sds = jax.ShapeDtypeStruct
    x, head = sds((1, tokens, d), jnp.float32), sds((d, vocab), jnp.float32)
    lp = sds((1, tokens, vocab), jnp.float32)
    targets, mask = sds((1, tokens), jnp.int32), sds((1, tokens), jnp.float32)
    loss = lambda x, head, lp, t, m: fn(x, head, TeacherOutput(lp), t, m, vocab - 64)[0]
    grad = jax.jit(jax.grad(loss, (0, 1)))
    return grad.lower(x, head, lp, targets, mask).compile().memory_analysis().temp_size_in_bytes


def test_memory_at_real_sizes():
    """4,096 tokens, d = 2048, dense teacher (the worst case: read in place, never copied).
    Measured on CPU: whole 8,192 MiB at V = 128k; chunked 1,316 MiB at 128k, of which
    1,024 MiB is one chunk's head-gradient term before it joins the accumulator (a [d, V]
    float32; the accumulator itself is the output), and 1,072 MiB at 32k (256 MiB head):
    beyond the head, 292 MiB at 128k and 816 MiB at 32k (the chunk's logits are 256 MiB at
    both)."""
    cfg = DistillLossConfig(loss="forward_kl", temperature=T, alpha=0.5)
    whole = lambda x, head, t, tg, m, live: losses.kd_loss(
        whole_logits(x, head, live), t, tg, m, cfg, vocab_limit=live
    )
    chunked = lambda x, head, t, tg, m, live: kd_loss_chunked(
        x, head, t, tg, m, cfg, vocab_limit=live
    )
    one_logits = 4096 * 131072 * 4  # 2 GiB
    whole_128k = _temp_bytes(whole, 131072)
    chunked_128k = _temp_bytes(chunked, 131072)
    chunked_32k = _temp_bytes(chunked, 32768)
    beyond_head = lambda temp, vocab: temp - 2048 * vocab * 4
    assert whole_128k > 3 * one_logits  # what this module exists to avoid
    assert chunked_128k < one_logits
    assert beyond_head(chunked_128k, 131072) < one_logits / 4
    assert beyond_head(chunked_128k, 131072) < 1.5 * beyond_head(chunked_32k, 32768)


def _dots(jaxpr) -> int:
    """dot_general equations in a jaxpr, its sub-jaxprs (scan bodies, custom rules) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "dot_general"
        for sub in jaxprs_in_params(eqn.params):
            n += _dots(sub)
    return n


def test_the_training_losses_form_their_gradient_in_one_pass_over_the_logits():
    """value_and_grad of the chunked KD loss makes each chunk's logits once: three head
    matmuls in all (the logits, d x, d head), none recomputed in the backward pass; and the
    gradient scales with the loss's cotangent (here 3 x the loss plus a term of x alone)."""
    x, head, teacher_z, targets, mask = make_inputs(seed=7)
    teacher = teacher_of(teacher_z, 5)
    cfg = DistillLossConfig(loss="forward_kl", temperature=T, alpha=0.6)

    def chunked(x, head):
        loss, _ = kd_loss_chunked(
            x, head, teacher, targets, mask, cfg, vocab_limit=LIVE, chunk=CHUNK
        )
        return 3.0 * loss + jnp.sum(x**2)

    def whole(x, head):
        loss, _ = losses.kd_loss(
            whole_logits(x, head), teacher, targets, mask, cfg, vocab_limit=LIVE
        )
        return 3.0 * loss + jnp.sum(x**2)

    grad = jax.value_and_grad(chunked, (0, 1))
    assert _dots(jax.make_jaxpr(grad)(x, head).jaxpr) == 3
    (got, got_grads), (want, want_grads) = (
        fast_jit(grad)(x, head),
        fast_jit(jax.value_and_grad(whole, (0, 1)))(x, head),
    )
    assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert_close(g, w, rtol=2e-5)
