"""The 2026 mixture-of-experts teachers, read from checkpoints that transformers itself
writes: DeepSeek-V3 (latent attention with and without low-rank queries, YaRN with its
attention temperature, interleaved RoPE, group-limited sigmoid routing with the
selection-only correction bias, shared experts, dense first layers, a multi-token
prediction layer skipped), Kimi K2 (the same architecture under its own model_type) and
GLM-4.5 (partial RoPE, q/k/v biases, the same routing), each against transformers'
log-probs at tp x ep layouts, and back out through export."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from distill.mesh import teacher_mesh  # noqa: E402
from distill.models import hf  # noqa: E402
from distill.models.hf import export as hf_config  # noqa: E402
from distill.models.hf import files as hf_files  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.hf import load_hf_teacher  # noqa: E402
from tests.test_hf import _batch, _hf_logits  # noqa: E402

LIVE = 96
DEEPSEEK = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
    kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 64, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
)  # fmt: skip
CASES = {  # name: (transformers class prefix, config class, config keys, model_type written)
    "deepseek_v3": ("DeepseekV3", "DeepseekV3Config", DEEPSEEK, None),
    "deepseek_v3_full_rank_q": (
        "DeepseekV3",
        "DeepseekV3Config",
        {**DEEPSEEK, "q_lora_rank": None, "rope_parameters": {"rope_type": "default"}},
        None,
    ),  # fmt: skip
    # Kimi K2's text model is DeepSeek-V3's; its config.json says model_type kimi_k2
    "kimi_k2": (
        "DeepseekV3",
        "DeepseekV3Config",
        {**DEEPSEEK, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827},
        "kimi_k2",
    ),  # fmt: skip
    "glm4_moe": (
        "Glm4Moe",
        "Glm4MoeConfig",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            attention_bias=True,
            use_qk_norm=True,
            norm_topk_prob=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
        None,
    ),  # fmt: skip
}


def _save(path, name):
    """A tiny transformers model of CASES[name], O(1) random weights and correction biases
    (a buffer, so set by hand), saved at `path`; read back in float32 with eager attention."""
    prefix, config_class, keys, model_type = CASES[name]
    torch.manual_seed(0)
    m = getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, config_class)(**keys))
    with torch.no_grad():
        for pname, p in m.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in pname else p.normal_(0.0, 0.3)
        for bname, b in m.named_buffers():
            if "e_score_correction_bias" in bname:
                b.normal_(0.0, 1.0)  # large enough to change which experts are chosen
    m.save_pretrained(str(path))
    ref = type(m).from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    if model_type:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "model_type": model_type}))
    return ref.eval()


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """(name, directory, transformers' log-probs on the batch, the batch)."""
    path = tmp_path_factory.mktemp(request.param)
    ref = _save(path, request.param)
    batch = _batch(LIVE, b=4, s=12)
    logp = torch.log_softmax(torch.tensor(_hf_logits(ref, batch.tokens)), -1).numpy()
    return request.param, path, logp, batch


def _logprobs(logits):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


LAYOUTS = [(1, 1, 1), (1, 2, 2), (1, 1, 4), (2, 2, 1), (2, 1, 1), (2, 1, 2)]  # (pp, ep, tp)


@pytest.mark.parametrize("pp, ep, tp", LAYOUTS)
def test_teacher_logprobs_match_transformers(family, pp, ep, tp):
    """At tp x ep layouts, and in two pipeline stages (the layers split unevenly where
    the dense first layers and the MoE ones do not divide)."""
    name, path, want, batch = family
    cfg = hf.read_model_config(path)
    mesh = teacher_mesh(jax.devices()[: pp * ep * tp], 1, tp, ep, pp)
    params = load_hf_teacher(path, cfg, mesh)
    got = make_forward(cfg, mesh, mode="logits")(params, batch)
    np.testing.assert_allclose(_logprobs(got), want, atol=2e-4, rtol=1e-4, err_msg=name)


def test_config_reads_each_family(family):
    name, path, _, _ = family
    cfg = hf.read_model_config(path)
    assert cfg.family == (CASES[name][3] or name.split("_full")[0])
    assert cfg.router_score == "sigmoid" and cfg.router_correction_bias
    assert cfg.moe_layers() == (False, True, True)  # first_k_dense_replace = 1
    assert cfg.f_shared == 16 and not cfg.shared_expert_gate
    if name.startswith("glm"):
        assert (cfg.partial_rotary_factor, cfg.qkv_bias, cfg.qk_norm) == (0.5, True, True)
        assert not cfg.mla
    else:
        assert cfg.mla and cfg.hd == 12 and cfg.v_dim == 6 and cfg.rope_interleave
        assert cfg.q_lora_rank == (None if "full_rank" in name else 24)


def test_the_multi_token_prediction_layer_is_skipped(tmp_path, caplog):
    """A released DeepSeek-V3 stores layer num_hidden_layers (its MTP module): not read,
    and the load says so."""
    from safetensors.numpy import load_file, save_file

    _save(tmp_path, "deepseek_v3")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    extra = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if ".2." in k}
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"), {"format": "pt"})
    cfg = hf.read_model_config(tmp_path)
    with caplog.at_level("INFO", logger="distill"):
        hf_files.check_checkpoint(tmp_path, cfg, tp=1)
    assert "skipping stored layer(s) 3 past num_hidden_layers=3" in caplog.text


def test_export_round_trips_through_transformers(family, tmp_path):
    """The config.json written for the family's model is read back as it by transformers
    and by distill (Kimi K2 exports as deepseek_v3, the class transformers has)."""
    name, path, _, _ = family
    cfg = hf.read_model_config(path)
    raw = hf_config.to_hf_config(cfg, max_position_embeddings=256)
    assert raw["model_type"] == ("deepseek_v3" if name == "kimi_k2" else cfg.family)
    back = transformers.AutoConfig.for_model(**raw)
    assert type(back).__name__ == CASES[name][1]
    if cfg.mla:
        assert (back.kv_lora_rank, back.q_lora_rank, back.v_head_dim) == (
            cfg.kv_lora_rank, cfg.q_lora_rank, cfg.v_head_dim
        )  # fmt: skip
    assert back.n_routed_experts == cfg.n_experts and back.first_k_dense_replace == 1
