"""gpt-oss read from checkpoints transformers writes: attention sinks, q/k/v/o biases,
alternating sliding and full layers, YaRN, the biased router with the softmax of its top-k
logits, biased experts with the clamped SwiGLU, stored fused (gate and up interleaved)
against transformers' log-probs at tp x ep layouts; the released MXFP4 experts load to the
dequantized checkpoint bit for bit; export writes the fused layout transformers loads."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from distill.mesh import teacher_mesh  # noqa: E402
from distill.models import hf  # noqa: E402
from student.export import hf_tensors  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.hf import load_hf_teacher, read_hf_layers  # noqa: E402
from tests.test_hf import _batch, _hf_logits  # noqa: E402
from tests.test_quantized import MXFP4_CONFIG, pack_mxfp4  # noqa: E402

LIVE = 96
GPT_OSS = dict(
    vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
    num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                     "original_max_position_embeddings": 64, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False},
)  # fmt: skip


def _save(path):
    torch.manual_seed(0)
    m = transformers.GptOssForCausalLM(transformers.GptOssConfig(**GPT_OSS))
    with torch.no_grad():  # O(1) weights and biases; gate/up large enough to reach the clamp
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(
                0.0, 0.5 if "sinks" in name else 0.3
            )
    m.save_pretrained(str(path))
    return type(m).from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    ref = _save(path).eval()
    batch = _batch(LIVE, b=4, s=12)
    logp = torch.log_softmax(torch.tensor(_hf_logits(ref, batch.tokens)), -1).numpy()
    return path, ref, logp, batch


def test_config(gpt_oss):
    cfg = hf.read_model_config(gpt_oss[0])
    assert cfg.attn_sinks and cfg.qkv_bias and cfg.o_bias and cfg.router_bias and cfg.expert_bias
    assert cfg.activation == "swiglu_clamped" and cfg.norm_topk_prob
    assert cfg.types() == ("sliding", "full", "sliding") and cfg.rope_scaling.type == "yarn"
    assert not cfg.rope_scaling.truncate


LAYOUTS = [(1, 1, 1), (1, 2, 2), (1, 1, 4), (2, 2, 1), (2, 1, 1), (2, 1, 2)]  # (pp, ep, tp)


@pytest.mark.parametrize("pp, ep, tp", LAYOUTS)
def test_teacher_logprobs_match_transformers(gpt_oss, pp, ep, tp):
    """At tp x ep layouts, and in two pipeline stages (3 layers: 2 and 1)."""
    path, _, want, batch = gpt_oss
    cfg = hf.read_model_config(path)
    mesh = teacher_mesh(jax.devices()[: pp * ep * tp], 1, tp, ep, pp)
    got = make_forward(cfg, mesh, mode="logits")(load_hf_teacher(path, cfg, mesh), batch)
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(got, jnp.float32), axis=-1))
    np.testing.assert_allclose(logp, want, atol=2e-4, rtol=1e-4)


def test_export_writes_the_fused_layout_transformers_loads(gpt_oss):
    """The tensors export writes equal the checkpoint's, fused gate/up interleaved."""
    path, _, _, _ = gpt_oss
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    written = hf_tensors(cfg, params)
    stored = load_file(str(path / "model.safetensors"))
    assert set(written) == set(stored)
    for name, w in written.items():
        np.testing.assert_array_equal(w, stored[name].numpy(), err_msg=name)


def test_mxfp4_experts_load_as_the_dequantized_checkpoint(gpt_oss, tmp_path):
    """The experts replaced by MXFP4 blocks and scales in the released layout; loaded at
    ep=2 x tp=2 they equal the bf16 checkpoint of the same values dequantized by
    transformers, bit for bit, and its forward gives the same outputs."""
    path, _, _, batch = gpt_oss
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(0)
    quant, plain = dict(tensors), dict(tensors)
    e, d, f = 4, 64, 32
    for i in range(GPT_OSS["num_hidden_layers"]):
        for name, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = pack_mxfp4(rng, e, rows, cols)
            scales[:] = torch.from_numpy(rng.integers(122, 127, scales.shape, dtype=np.uint8))
            del quant[key]
            quant[key + "_blocks"], quant[key + "_scales"] = blocks, scales
            plain[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    raw = json.loads((path / "config.json").read_text())
    for where, tree, extra in (
        (tmp_path / "q", quant, MXFP4_CONFIG),
        (tmp_path / "p", plain, None),
    ):
        where.mkdir()
        save_file({k: v.contiguous() for k, v in tree.items()}, str(where / "model.safetensors"))
        (where / "config.json").write_text(
            json.dumps({**raw, **({"quantization_config": extra} if extra else {})})
        )
    cfg = hf.read_model_config(tmp_path / "q")
    mesh = teacher_mesh(jax.devices()[:4], 1, 2, 2)
    got = load_hf_teacher(tmp_path / "q", cfg, mesh, dtype=jnp.bfloat16)
    want = load_hf_teacher(tmp_path / "p", cfg, mesh, dtype=jnp.bfloat16)
    for key in ("we_gate", "we_up", "we_down"):
        a, b = np.asarray(got["layers"][key]), np.asarray(want["layers"][key])
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=key)
    fwd = make_forward(cfg, mesh, mode="logits")
    np.testing.assert_array_equal(np.asarray(fwd(got, batch)), np.asarray(fwd(want, batch)))
