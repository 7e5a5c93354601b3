"""What only a CUDA GPU can show: the shapes that crashed on one (issue 32), run for real.

Skipped elsewhere. tests/conftest.py pins the suite to the simulated CPU devices, so on a GPU
machine run these with the GPU visible:

    JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu -n 0 -q

- a top-k over more rows of a 128,256-id vocabulary than XLA:GPU's 32-bit sort offsets
  reach in one call (16,744 rows): `distill.models.topk.top_k` splits the calls, and equals
  `jax.lax.top_k` taken on a few rows at a time;
- the 1B student step of `pipelines/llama3-8b-to-1b.yaml` at 8 rows of 4,096 tokens (its
  logits chunks and saved activations past 2^31 elements in all), the batch that killed
  the process before.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.models import topk

pytestmark = pytest.mark.gpu


def _cuda() -> jax.Device | None:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return gpus[0] if "cuda" in gpus[0].client.platform_version.lower() else None


needs_cuda = pytest.mark.skipif(_cuda() is None, reason="needs a CUDA GPU")


@needs_cuda
def test_top_k_past_32_bit_sort_offsets():
    rows, vocab, k = 20_000, 128_256, 64  # 2.6e9 elements: more than one CUB sort can index
    with jax.default_device(_cuda()):
        x = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32)
        values, ids = jax.jit(lambda a: topk.top_k(a, k))(x)
        for start in (0, rows // 2, rows - 2_000):
            want_v, want_i = jax.lax.top_k(x[start : start + 2_000], k)
            np.testing.assert_array_equal(values[start : start + 2_000], want_v)
            np.testing.assert_array_equal(ids[start : start + 2_000], want_i)


@needs_cuda
def test_1b_student_step_at_8_rows_of_4096(tmp_path, capsys):
    from pipelines.commands.cli import main

    code = main([
        "bench", "pipelines/llama3-8b-to-1b.yaml", "--role", "student", "--repeats", "2",
        "--set", "mesh.teacher.dp=1", "--set", "mesh.student.fsdp=1",
        "--set", "train.batch_size=8", "--set", "train.grad_accum=1",
        "--set", "data.max_bytes=1000000", "--set", f"run.output_dir={tmp_path}/out",
    ])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    result = json.loads(out.out.strip().splitlines()[-1])
    assert result["student_ms"] > 0 and result["tokens_per_step"] == 8 * 4096


@needs_cuda
def test_mosaic_grouped_matmul_equals_the_tiled_kernel():
    """On a Hopper GPU the MoE layer takes the Pallas Mosaic GPU kernels; its output and
    gradients equal the tiled XLA kernel's (bfloat16 tolerance), rows of no expert zero."""
    from distill.models.experts import grouped

    if not grouped.hopper():
        pytest.skip("the Mosaic grouped matmul is written for Hopper GPUs")
    assert grouped.kernel("gpu") == "mosaic_gpu"
    d, e, f, rows = 256, 16, 512, 4096
    keys = jax.random.split(jax.random.key(0), 6)
    with jax.default_device(_cuda()):
        x = jax.random.normal(keys[0], (rows // 4, d), jnp.bfloat16)
        w = [
            (jax.random.normal(k, s) * 0.05).astype(jnp.bfloat16)
            for k, s in zip(keys[1:4], [(e, d, f), (e, d, f), (e, f, d)], strict=True)
        ]
        src = jnp.arange(rows) // 4
        expert = jax.random.randint(keys[4], (rows,), 0, e + 1)  # e: no expert
        probe = jax.random.normal(keys[5], (rows, d))

        def loss(kernel, x, *w):
            experts = grouped.Experts(*w)
            y = grouped.expert_rows(
                x, src, expert, experts, lambda g, u: jax.nn.silu(g) * u, kernel
            )
            return jnp.sum(y.astype(jnp.float32) * probe), y

        run = jax.jit(
            jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True), static_argnums=0
        )
        (_, y), grads = run("mosaic_gpu", x, *w)
        (_, want), want_grads = run("tiled", x, *w)
    np.testing.assert_allclose(np.float32(y), np.float32(want), atol=2e-2, rtol=2e-2)
    assert not np.asarray(y, np.float32)[np.asarray(expert) == e].any()
    for got, ref in zip(grads, want_grads, strict=True):
        scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
        np.testing.assert_allclose(np.float32(got), np.float32(ref), atol=2e-2 * scale)
