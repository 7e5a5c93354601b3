"""Qwen3.5 text (`qwen3_5_text`): three of every four layers Gated DeltaNet linear
attention (`distill.models.linear_attention`), the fourth full attention with an output
gate (q_proj doubled: each head's queries, then its gate), per-head query/key norms and
partial RoPE (a quarter of head_dim 256 rotated); every RMSNorm but the linear layers'
gated one scales by (1 + weight), as Gemma's. Its multimodal RoPE reduces, for text, to
plain positions (the three position streams are equal). The mixture (`qwen3_5_moe_text`)
has routed experts in every layer (softmax top-k, always renormalised) and a shared expert
with a sigmoid gate, Qwen2-MoE's, saved by transformers one expert at a time. The released Qwen3.5
checkpoints are `qwen3_5` / `qwen3_5_moe` image-text models: their text model (config.json's
`text_config`, the weights under `model.language_model.`) is read, the vision tower and the
multi-token-prediction layer (`mtp.`) are not."""

from __future__ import annotations

from distill.models.families.moe import read_experts, write_experts
from distill.models.families.record import Family, register

LINEAR_KEYS = {  # ModelConfig key: config.json key
    "linear_k_heads": "linear_num_key_heads",
    "linear_v_heads": "linear_num_value_heads",
    "linear_k_dim": "linear_key_head_dim",
    "linear_v_dim": "linear_value_head_dim",
    "linear_conv_kernel": "linear_conv_kernel_dim",
}
DEFAULTS = {"linear_k_heads": 16, "linear_v_heads": 32, "linear_k_dim": 128, "linear_v_dim": 128,
            "linear_conv_kernel": 4}  # fmt: skip


# A weight name `stored{ROWS}a:b` is the rows [a, b) of the stored tensor (`distill.models.hf`)
ROWS = "@"
# Qwen3.5's Gated DeltaNet (`distill.models.linear_attention`) after `model.layers.{i}.`;
# its fused q, k, v projection and convolution are read as row ranges (`linear_weights`).
LINEAR_WEIGHTS = {
    "lin_wz": ("linear_attn.in_proj_z.weight", True),
    "lin_wb": ("linear_attn.in_proj_b.weight", True),
    "lin_wa": ("linear_attn.in_proj_a.weight", True),
    "lin_a_log": ("linear_attn.A_log", False),
    "lin_dt_bias": ("linear_attn.dt_bias", False),
    "lin_norm": ("linear_attn.norm.weight", False),
    "lin_wo": ("linear_attn.out_proj.weight", True),
}
# The attention weights a linear layer does not have.
ATTENTION_KEYS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm", "sinks")


def linear_weights(cfg) -> dict[str, tuple[str, bool]]:
    """A linear-attention layer's tensors: `LINEAR_WEIGHTS` and the q, k, v rows of the
    fused `in_proj_qkv` [2 * Hk * dk + Hv * dv, D] and `conv1d` [same, 1, K]."""
    qk = cfg.linear_k_heads * cfg.linear_k_dim
    vd = cfg.linear_v_heads * cfg.linear_v_dim
    ranges = {"q": (0, qk), "k": (qk, 2 * qk), "v": (2 * qk, 2 * qk + vd)}
    names = dict(LINEAR_WEIGHTS)
    for part, (a, b) in ranges.items():
        names[f"lin_w{part}"] = (f"linear_attn.in_proj_qkv.weight{ROWS}{a}:{b}", True)
        names[f"lin_conv_{part}"] = (f"linear_attn.conv1d.weight{ROWS}{a}:{b}", False)
    return names


def mixer_weights(cfg, linear: bool, names: dict) -> dict[str, tuple[str, bool]]:
    """A layer's weight names (`distill.models.hf.layer_weights`) without the attention
    weights and with `linear_weights` when it is a linear layer."""
    if not linear:
        return names
    return {k: v for k, v in names.items() if k not in ATTENTION_KEYS} | linear_weights(cfg)


def hf_shape(cfg, key: str) -> tuple[int, ...]:
    """A linear layer's weight as transformers stores it: [out, in] of each [in, out]."""
    shape = linear_shapes(cfg)[key]
    return shape[::-1] if len(shape) == 2 else shape


def linear_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """One linear-attention layer's weights and their shapes (projections [in, out],
    the convolution as transformers stores it, [channels, 1, kernel])."""
    d, hk, hv = cfg.d_model, cfg.linear_k_heads, cfg.linear_v_heads
    qk, vd = hk * cfg.linear_k_dim, hv * cfg.linear_v_dim
    k = cfg.linear_conv_kernel
    return {
        "lin_wq": (d, qk),
        "lin_wk": (d, qk),
        "lin_wv": (d, vd),
        "lin_wz": (d, vd),
        "lin_wb": (d, hv),
        "lin_wa": (d, hv),
        "lin_conv_q": (qk, 1, k),
        "lin_conv_k": (qk, 1, k),
        "lin_conv_v": (vd, 1, k),
        "lin_a_log": (hv,),
        "lin_dt_bias": (hv,),
        "lin_norm": (cfg.linear_v_dim,),
        "lin_wo": (vd, d),
    }


def _windows(raw: dict, n: int, where, kind: str) -> list[str]:
    """Linear layers but every `full_attention_interval`-th (4) when config.json has no
    layer_types."""
    every = raw.get("full_attention_interval", 4)
    return ["full" if (i + 1) % every == 0 else "linear" for i in range(n)]


def _read(raw: dict, where) -> dict:
    linear = {key: raw.get(name, DEFAULTS[key]) for key, name in LINEAR_KEYS.items()}
    return {"norm_offset": 1.0, "qk_norm": True, "attn_output_gate": True, **linear}


def _write(cfg) -> dict:
    return {name: getattr(cfg, key) for key, name in LINEAR_KEYS.items()}


QWEN3_5_TEXT = register(
    Family(
        model_type="qwen3_5_text",
        architecture="Qwen3_5ForCausalLM",
        parts=(
            "Gated DeltaNet linear attention (chunked gated delta rule)",
            "attention output gate",
            "per-head query/key RMSNorm",
            "partial RoPE",
            "norm offset 1",
        ),  # fmt: skip
        read=_read,
        write=_write,
        windows=_windows,
        image_text="qwen3_5",
    )
)


def _read_moe(raw: dict, where) -> dict:
    """Every layer routed; config.json has no dense width, so d_ff (what a dense student of
    it inherits) is the width a token uses: its experts' and the shared expert's."""
    shared = raw.get("shared_expert_intermediate_size") or 0
    experts = read_experts(raw, always_norm=True, qwen_layers=True)
    active = experts["experts_per_token"] * experts["d_ff_expert"] + shared
    return {**_read(raw, where), **experts, "d_ff_shared": shared, "d_ff": active}


def _write_moe(cfg) -> dict:
    keys = write_experts(cfg, qwen_layers=True)  # mlp_only_layers: none, read back as none
    return {**_write(cfg), **keys, "shared_expert_intermediate_size": cfg.f_shared}


QWEN3_5_MOE_TEXT = register(
    Family(
        model_type="qwen3_5_moe_text",
        architecture="Qwen3_5MoeForCausalLM",
        parts=(*QWEN3_5_TEXT.parts, "routed experts (softmax top-k)", "gated shared expert"),
        read=_read_moe,
        write=_write_moe,
        windows=_windows,
        accepts=frozenset({"shared_expert_intermediate_size"}),
        dense="qwen3_5_text",
        image_text="qwen3_5_moe",
    )
)
