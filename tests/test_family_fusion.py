"""The per-family operations fuse into the existing kernels: compiled on CPU, a block of each
family makes no extra pass over its activations compared with Llama's block of the same
shapes, beyond the reductions its extra norms must make.

What is counted, in the optimized HLO of the forward (one layer, unrolled so the block sits
in the entry computation): each instruction that writes an activation-sized buffer
([B, S, D], [B, S, heads, hd] or larger) and each that only reads one (a reduction to
[B, S] or [B, S, heads]). Measured on XLA:CPU in float32 (the CPU compute dtype):

- Qwen2's q/k/v biases: none. They are added in the fusion that applies RoPE and lays out
  the heads.
- Qwen3's q/k norms: one reduction each (the mean square per head); their scale is fused
  into the RoPE fusion, so nothing more is written.
- Gemma's post-attention and post-MLP norms: one reduction each; each scale is fused into
  its residual add. Gemma 3's q/k norms as Qwen3's. Soft-capped attention scores, the query
  scale and GeGLU's tanh GELU fuse into the ops Llama has.
- The final logit soft-cap: nothing; its tanh is fused into the head matmul's output, so
  the [B, S, V] logits are not passed over again.
- Gemma's embedding scale (times sqrt(d_model)): one extra [B, S, D] write per forward (not
  per layer). XLA:CPU's reduction kernel does not take the multiply as its input's
  producer, so the scaled embeddings are written once for the first norm's reduction; in
  bfloat16 the multiply fuses into the embedding gather and costs nothing.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from distill.config import ModelConfig
from distill.models import model

B, S, D, H, KV, HD, F = 4, 64, 48, 4, 2, 16, 96
# Weights hold at most D * F = 4,608 elements: any buffer of B * S * min(D, KV * HD) = 8,192
# or more is an activation.
ACTIVATION = B * S * min(D, KV * HD)
SHAPE = dict(vocab_size=128, d_model=D, n_layers=1, n_heads=H, n_kv_heads=KV, head_dim=HD)
GEMMA = dict(norm_offset=1.0, post_norms=True, activation="gelu_tanh", embed_scale=True)
FAMILIES = {  # name: (config keys, (extra writes, extra reads) against Llama)
    "qwen2": (dict(family="qwen2", qkv_bias=True), (0, 0)),
    "qwen3": (dict(family="qwen3", qk_norm=True), (0, 2)),
    "gemma2": (
        dict(family="gemma2", query_scale=0.2, attn_softcap=50.0, final_softcap=30.0, **GEMMA),
        (1, 2),
    ),
    "gemma3": (dict(family="gemma3_text", query_scale=0.25, qk_norm=True, **GEMMA), (1, 4)),
}
# %name = shape op(operands): an array's shape f32[4,64,48]{2,1,0} or a tuple's (f32[...], ...)
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = (\(.*?\)|\w+\[[\d,]*\]\S*) ([\w-]+)\((.*?)\)")
_NOT_A_PASS = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element"}


def _elements(shape: str) -> int:
    """Elements of an array shape, or of a tuple's largest array (a loop's state)."""
    largest = 0
    for dims in re.findall(r"\[([\d,]*)\]", shape):
        n = 1
        for dim in filter(None, dims.split(",")):
            n *= int(dim)
        largest = max(largest, n)
    return largest


def activation_passes(hlo: str, activation: int = ACTIVATION) -> tuple[int, int]:
    """(instructions writing a buffer of `activation` elements or more, instructions only
    reading one) in the entry computation of optimized HLO text."""
    sizes, writes, reads = {}, 0, 0
    for line in hlo[hlo.index("\nENTRY") :].splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, op, operands = match.groups()
        sizes[name] = _elements(shape)
        if op in _NOT_A_PASS:
            continue
        read = max((sizes.get(a.strip().lstrip("%"), 0) for a in operands.split(",")), default=0)
        writes += sizes[name] >= activation
        reads += sizes[name] < activation <= read
    return writes, reads


def compiled_forward(keys: dict, dtype: str = "float32") -> str:
    """Optimized HLO of the one-layer forward to the final hidden states, on CPU."""
    cfg = ModelConfig(**SHAPE, d_ff=F, attention="prefix", **keys)  # CPU's kernel for S <= 512

    def hidden(params, tokens, segment_ids, positions):
        return model.apply_hidden(
            cfg, params, tokens, segment_ids, positions, dtype=dtype, unroll=True
        )[0]

    rows = jnp.zeros((B, S), jnp.int32)
    args = (model.abstract_params(cfg), rows, rows, rows)
    return jax.jit(hidden).lower(*args).compile().as_text()


@pytest.fixture(scope="module")
def llama():
    return activation_passes(compiled_forward({}))


def test_llama_block_passes(llama):
    """The count sees a block's passes: the three projections, attention's, the output
    projection, the MLP's, two residual adds, each norm's reduction (two and the final)."""
    writes, reads = llama
    assert writes >= 15 and reads >= 3, llama


@pytest.mark.parametrize("name", FAMILIES)
def test_family_adds_only_its_norms_reductions(name, llama):
    keys, (extra_writes, extra_reads) = FAMILIES[name]
    writes, reads = activation_passes(compiled_forward(keys))
    assert (writes - llama[0], reads - llama[1]) == (extra_writes, extra_reads), name


def test_the_count_sees_an_unfused_bias(llama, monkeypatch):
    """A bias added in a pass of its own (a loop over the projection's output, whose trip
    count XLA cannot know: 1 unless x is NaN) shows as extra writes: the check can fail. An
    add merely held apart by optimization barriers does not: XLA:CPU fuses it into the
    matmul's epilogue all the same."""
    matmul = model.matmul

    def biased_apart(x, w):
        once = (x[0, 0, 0] == x[0, 0, 0]).astype(jnp.int32)
        return jax.lax.fori_loop(0, once, lambda _, y: y + 1.0, matmul(x, w))

    monkeypatch.setattr(model, "matmul", biased_apart)
    apart = activation_passes(compiled_forward({}))
    assert apart[0] >= llama[0] + 7, (llama, apart)  # one per projection (q, k, v, o, MLP)


def test_the_final_softcap_adds_no_pass_over_the_logits():
    """The teacher's head: logits, then log-softmax; capped and plain make the same passes
    over [B, S, V]."""
    v = 512
    x = jax.ShapeDtypeStruct((B, S, D), jnp.float32)
    head = jax.ShapeDtypeStruct((D, v), jnp.float32)

    def passes(cap):
        def log_probs(x, head):
            return jax.nn.log_softmax(model.logits(x, head, cap), -1)

        return activation_passes(jax.jit(log_probs).lower(x, head).compile().as_text(), B * S * v)

    plain = passes(None)
    assert plain[0] >= 2, plain  # the logits and the log-probs are written
    assert passes(30.0) == plain
