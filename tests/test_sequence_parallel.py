"""Sequence parallelism in the teacher's tensor-parallel layers (`teacher.forward`,
`distill.collectives.SequenceParallel`): the forward with the residual stream and norms on
1/tp of the positions gives plain tp's outputs to 1e-6 (float32) for a plain, a windowed
and soft-capped, a mixture-of-experts and an OLMoE-like (query/key norms over all heads)
family, with cp beside it too; its program reduce-scatters and all-gathers in place of the
all-reduces of [B, S, D] activations; and its compiled temporaries fall (compile-only).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.config import ModelConfig
from distill.mesh import teacher_mesh
from distill.models import model
from distill.types import Batch
from teacher.forward import make_forward
from teacher.sharding import batch_sharding, shard_params
from tests.test_context_parallel import _batch
from tests.test_teacher_stages import FAMILIES, SMALL

OLMOE = ModelConfig(
    **SMALL, qk_norm=True, qk_norm_full=True, n_experts=4, experts_per_token=2, d_ff_expert=16
)
CONFIGS = {**FAMILIES, "olmoe": OLMOE}


def _forward(family, tp, cp, ep, sp, **kw):
    cfg = CONFIGS[family]
    mesh = teacher_mesh(jax.devices()[: ep * cp * tp], 1, tp, ep, 1, cp)
    fwd = make_forward(cfg, mesh, sequence_parallel=sp, **kw)
    return cfg, mesh, fwd


@pytest.mark.parametrize(
    "family, tp, cp, ep, mode",
    [
        ("dense", 2, 1, 1, "topk"),
        ("windowed", 4, 1, 1, "dense"),
        ("moe", 2, 1, 2, "topk"),
        ("olmoe", 2, 1, 1, "dense"),
        ("windowed", 2, 2, 1, "topk"),
    ],
)
def test_sequence_parallel_tp_gives_plain_tps_outputs(family, tp, cp, ep, mode):
    kw = {"mode": mode, "top_k": 5 if mode == "topk" else None, "microbatch": 2}
    batch = _batch(4, 0)
    outs = []
    for sp in (False, True):
        cfg, mesh, fwd = _forward(family, tp, cp, ep, sp, **kw)
        params = shard_params(model.init_params(cfg, 1), cfg, mesh)
        outs.append(fwd(params, jax.device_put(batch, batch_sharding(mesh))))
    for g, w in zip(jax.tree.leaves(outs[1]), jax.tree.leaves(outs[0]), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=0)


def _compiled(cfg, tp: int, sp: bool, seq: int):
    mesh = teacher_mesh(jax.devices()[:tp], 1, tp)
    params = jax.eval_shape(lambda: shard_params(model.init_params(cfg, 1), cfg, mesh))
    fwd = make_forward(cfg, mesh, mode="topk", top_k=8, sequence_parallel=sp)
    put = batch_sharding(mesh)
    i32 = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=put)
    batch = Batch(i32, i32, i32, i32, jax.ShapeDtypeStruct((1, seq), jnp.float32, sharding=put))
    return fwd.lower(params, batch)


def test_its_program_scatters_and_gathers_and_its_temporaries_fall():
    """tp = 4, one row of 4,096 tokens (D = 512, F / tp = 128): the all-reduces of the
    embedding, attention output and MLP become reduce-scatters, each column-parallel input
    an all-gather, and XLA's per-device temporaries fall (0.87x with the tests' XLA:CPU
    flags: a forward's peak is one layer's, whose gathered input, q/k/v and MLP slice stay
    whole; the residual stream and norms are what shrink)."""
    cfg = ModelConfig(vocab_size=256, d_model=512, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=512)
    plain, sp = (_compiled(cfg, 4, s, 4096) for s in (False, True))
    text = sp.as_text()
    assert text.count("reduce_scatter") == 3 and "reduce_scatter" not in plain.as_text()
    assert text.count("all_gather") >= 3
    temps = [c.compile().memory_analysis().temp_size_in_bytes for c in (plain, sp)]
    assert temps[1] <= 0.92 * temps[0], temps
