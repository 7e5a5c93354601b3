"""The exact top-k by chunk maxima equals `jax.lax.top_k` bit for bit, sharded or not, and
every sort or top-k runs in calls under `distill.limits.MAX_ELEMENTS` elements (compiled at real
shapes without running, for this CPU and lowered for CUDA)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill import collectives as cc
from distill import limits
from distill.config import ModelConfig
from distill.mesh import teacher_mesh
from distill.models import model, topk
from distill.models.cross.losses import uld_distance
from distill.types import Batch
from teacher.forward import make_forward

V = 1000  # not a multiple of the chunks below


def _data(kind: str, rows=6, v=V, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    normal = rng.normal(size=(rows, v)).astype(np.float32)
    if kind == "normal":
        return normal
    if kind == "ties":  # few distinct values, none of them 0: ties everywhere
        return rng.integers(-3, 3, size=(rows, v)).astype(np.float32) + 0.5
    if kind == "zeros":  # ties on zeros of both signs, a few larger values: the k-th is 0
        x = rng.integers(-2, 1, size=(rows, v)).astype(np.float32)
        x = np.where((x == 0) & (rng.random((rows, v)) < 0.5), np.float32(-0.0), x)
        return np.where(np.arange(v) % 300 == 1, 1.0, x).astype(np.float32)
    if kind == "few_finite":  # fewer finite values than k, the rest -inf (masked ids)
        return np.where(np.arange(v) % 97 == 5, normal, -np.inf).astype(np.float32)
    if kind == "all_-inf":
        return np.full((rows, v), -np.inf, np.float32)
    if kind == "inf":
        return np.where(np.arange(v) % 50 == 3, np.inf, normal).astype(np.float32)
    if kind == "nan":
        normal[1, 7], normal[2, 900] = np.nan, -np.nan
        return normal
    raise ValueError(kind)


def _assert_bit_equal(got, want):
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    got_v, want_v = np.asarray(got[0]), np.asarray(want[0])
    np.testing.assert_array_equal(got_v.view(np.int32), want_v.view(np.int32))


KINDS = ["normal", "ties", "zeros", "few_finite", "all_-inf", "inf", "nan"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k,chunk", [(8, 16), (40, 7), (64, 64)])
def test_equals_lax_top_k(kind, k, chunk):
    """Values (bits: -0, NaN signs) and ids equal `jax.lax.top_k`'s under jit, on a
    vocabulary no chunk divides; the fast path, where it is taken, alone as well."""
    x = jnp.asarray(_data(kind))
    want = jax.lax.top_k(x, k)
    _assert_bit_equal(jax.jit(lambda a: topk.top_k(a, k, chunk))(x), want)
    if k * chunk >= V:
        return
    chunks, exact = topk.select_chunks(x, k, chunk)
    assert bool(exact) == (kind not in ("zeros", "nan"))
    if exact:
        _assert_bit_equal(topk.of_chunks(x, chunks, chunk), want)


@pytest.mark.parametrize("k", [1, 15, 16, 999, 1000])
def test_k_near_the_vocabulary(k):
    """k * chunk at or past V takes `jax.lax.top_k`; k = 1 and k = V still agree."""
    x = jnp.asarray(_data("ties"))
    _assert_bit_equal(topk.top_k(x, k, 64), jax.lax.top_k(x, k))


def test_tp_sharded_equals_one_device():
    """`collectives.top_k` on 4 vocabulary shards (shard_map, each shard 250 ids, not a
    multiple of its chunks), ties across shards and ids past a vocabulary limit masked
    -inf: the same values and ids as `jax.lax.top_k` of the whole."""
    mesh = teacher_mesh(jax.devices()[:4], 1, 4)
    x = jnp.asarray(_data("ties", rows=8).reshape(2, 4, V))
    x = cc.mask_vocab(x, 997, None)
    k = 12

    def local(z):
        return cc.top_k(cc.mask_vocab(z, 997, "tp"), k, "tp")

    sharded = jax.jit(
        jax.shard_map(
            lambda z: (lambda v, i: (v, i))(*local(z)),
            mesh=mesh,
            in_specs=jax.P(None, None, "tp"),
            out_specs=(jax.P(), jax.P()),
        )
    )
    _assert_bit_equal(sharded(x), jax.lax.top_k(x, k))
    _assert_bit_equal(cc.top_k(x, k, None), jax.lax.top_k(x, k))


def test_tp_sharded_fast_path():
    """Each shard's own top-k by chunk maxima (k * chunk under the shard's 250 ids)."""
    mesh = teacher_mesh(jax.devices()[:4], 1, 4)
    x = jnp.asarray(_data("ties", rows=4, v=4 * 250))
    k = 3
    sharded = jax.shard_map(
        lambda z: tuple(cc.top_k(z, k, "tp")),
        mesh=mesh,
        in_specs=jax.P(None, "tp"),
        out_specs=(jax.P(), jax.P()),
    )
    assert k * topk.CHUNK < 250 and bool(topk.select_chunks(x[:, :250], k, topk.CHUNK)[1])
    _assert_bit_equal(jax.jit(sharded)(x), jax.lax.top_k(x, k))


@pytest.mark.parametrize("bound", [40, 151, 400, 3 * 50 * 2 + 1, 10**6])
def test_bounded_calls_equal_one_call(bound):
    """`by_rows` at bounds that split the rows unevenly, fold the leading dims into rows,
    or leave one call (rows past the bound, arrays under it): the same sort, top-k and
    gradient as one call."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 37, 50)), jnp.float32)
    sort = lambda a: -jnp.sort(-a, axis=-1)  # noqa: E731
    np.testing.assert_array_equal(topk.by_rows(sort, x, bound=bound), sort(x))
    got = topk.by_rows(lambda a: topk.top_k(a, 5, 4), x, bound=bound)
    _assert_bit_equal(got, jax.lax.top_k(x, 5))

    def loss(a, b):  # two arrays of one row count, different widths (ULD)
        p, q = topk.by_rows(lambda u, w: (sort(u), sort(w)), a, b, bound=bound)
        return jnp.sum(p[..., :20] * q)

    y = x[..., :20] * 2.0
    got = jax.grad(loss, argnums=(0, 1))(x, y)
    want = jax.grad(lambda a, b: jnp.sum(sort(a)[..., :20] * sort(b)), argnums=(0, 1))(x, y)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_uld_distance_in_bounded_calls(monkeypatch):
    lp = jax.nn.log_softmax(jnp.asarray(np.random.default_rng(2).normal(size=(2, 9, 30))))
    lq = jax.nn.log_softmax(jnp.asarray(np.random.default_rng(3).normal(size=(2, 9, 20))))
    want = uld_distance(lp, lq)
    monkeypatch.setattr(limits, "MAX_ELEMENTS", 100)  # rows of 30 ids: 3 rows a call
    np.testing.assert_allclose(uld_distance(lp, lq), want, rtol=1e-6)


# -- compiled at real shapes, never run -------------------------------------------------

_ARRAY = re.compile(r"%([\w.-]+) = ([a-z]\w*\[[\d,]*\])")
_SORT = re.compile(r" (sort|custom-call)\(([^)]*)\)(.*)")


def sort_operand_sizes(hlo: str) -> list[int]:
    """Elements of every operand of a sort or a TopK custom call in optimized HLO text."""
    shapes = dict(_ARRAY.findall(hlo))
    sizes = []
    for op, args, rest in _SORT.findall(hlo):
        if op == "custom-call" and 'custom_call_target="TopK"' not in rest:
            continue
        for name in re.findall(r"%([\w.-]+)", args):
            dims = shapes[name][shapes[name].index("[") + 1 : -1]
            sizes.append(math.prod(int(d) for d in dims.split(",") if d))
    return sizes


REAL = jax.ShapeDtypeStruct((16, 4096, 128256), jnp.float32)  # 8.4e9 elements


def test_no_sort_operand_reaches_2_31_at_real_shapes():
    """The bench's top-k of 16 rows of 4,096 tokens at a 128,256-id vocabulary and the
    ULD's sorts of the same compile into sorts and top-ks under 2^31 elements each."""
    programs = {
        "top-64": lambda z: topk.top_k(z, 64),
        "sort": topk.sort_descending,
        "top-64 unbounded": lambda z: jax.lax.top_k(z, 64),  # the check can fail
    }
    for name, f in programs.items():
        sizes = sort_operand_sizes(jax.jit(f).lower(REAL).compile().as_text())
        assert sizes, name
        assert (max(sizes) < 2**31) == (name != "top-64 unbounded"), (name, max(sizes))


def test_teacher_top_k_for_cuda_sorts_no_whole_vocabulary():
    """Lowered for CUDA on this CPU machine: the teacher's top-64 at 128,256 ids takes
    top-ks over the 2,004 chunk maxima and the 4,096 candidates; the whole vocabulary is
    only in the branch taken for NaNs or a zero k-th chunk maximum."""
    z = jax.ShapeDtypeStruct((2, 256, 128256), jnp.float32)
    text = jax.jit(lambda a: cc.top_k(a, 64, None)).trace(z).lower(lowering_platforms=("cuda",))
    text = text.as_text()
    widths = [int(w) for w in re.findall(r"chlo.top_k\(%\w+, k = 64\) : tensor<2x256x(\d+)x", text)]
    assert sorted(widths) == [2004, 4096, 128256]
    case = text[text.index('"stablehlo.case"') :]
    fallback = case[: case.index("}, {")]
    assert "2x256x128256xf32> -> " in fallback
    sorts = re.findall(r"func\.func private @sort\w*\(%arg0: tensor<(\w+)>", text)
    assert sorts == ["2x256x64xi32"] and text.count('"stablehlo.sort"') == 1  # chunk ids


def test_teacher_forward_at_real_shapes_sorts_under_2_31():
    """The teacher's top-64 forward (a one-layer model of 8B-to-1B's vocabulary), 16 rows
    of 4,096 tokens: every sort and top-k operand under 2^31 elements, none over a whole
    row of the vocabulary but the fallback's."""
    cfg = ModelConfig(
        vocab_size=128256, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=64
    )
    mesh = teacher_mesh(jax.devices()[:1], 1, 1)
    fwd = make_forward(cfg, mesh, mode="topk", top_k=64, microbatch=2)
    params = jax.eval_shape(lambda: model.init_params(cfg, 0))
    tokens = jax.ShapeDtypeStruct((16, 4096), jnp.int32)
    batch = Batch(tokens, tokens, tokens, tokens, jax.ShapeDtypeStruct((16, 4096), jnp.float32))
    sizes = sort_operand_sizes(fwd.lower(params, batch).compile().as_text())
    assert sizes and max(sizes) < 2**31
