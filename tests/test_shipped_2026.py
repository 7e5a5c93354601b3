"""The shipped layouts of the 2026 teachers (DeepSeek-V3 671B over two 8 x H200 hosts in
pipeline stages, gpt-oss-120b on one 8 x 80 GB host, gpt-oss-20b colocated with a small
student on one 80 GB GPU) and what their plans count: total and active parameters as the
model cards give them, the dense first layers and the shared expert, latent attention's
widths, sliding layers' keys, and the model's FLOPs against the compiled programs'."""

import json
import subprocess
import sys

import jax
import pytest

from distill.config import ModelConfig
from distill.config.load import config_from_dict, load_config
from distill.mesh import teacher_mesh
from distill.models import counts
from pipelines import plan
from pipelines.plan import memory as plan_memory
from tests.conftest import cli_env, tiny_config

DEEPSEEK = "pipelines/deepseek-v3-671b-to-qwen3-8b.yaml"
GPT_OSS_120B = "pipelines/gpt-oss-120b-to-qwen3-4b.yaml"
GPT_OSS_20B = "pipelines/gpt-oss-20b-to-qwen3-0.6b-one-gpu.yaml"


def test_the_shipped_teachers_are_their_model_cards():
    """Parameters from shapes alone: DeepSeek-V3 671B with 37B activated (8 of 256 routed
    experts and the shared one in 58 layers, the dense MLP in the first 3); gpt-oss-120b
    116.83B with 5.13B active and gpt-oss-20b 20.91B with 3.61B (the cards count the head,
    not the embedding). The students, of another family, inherit no latent attention or
    windows from their teachers."""
    ds, big, small = (load_config(p) for p in (DEEPSEEK, GPT_OSS_120B, GPT_OSS_20B))
    t = ds.teacher.model
    assert counts.param_count(t) == pytest.approx(671.03e9, rel=1e-4)
    assert counts.active_param_count(t) == pytest.approx(37.55e9, rel=1e-3)
    # each feed-forward is stored over the layers that run it; pipeline stages' one-shape
    # stack holds the dense MLP in the MoE layers and experts in the dense ones
    assert counts.stored_param_count(t) == counts.param_count(t)
    unused = counts.unused_param_count(t, union=True)
    assert counts.stored_param_count(t, union=True) - counts.param_count(t) == unused
    assert unused == 58 * 3 * 7168 * 18432 + 3 * ((256 * 3 + 3) * 7168 * 2048 + 7168 * 256 + 256)
    embed = lambda c: c.teacher.model.vocab_size * c.teacher.model.d_model  # noqa: E731
    for cfg, total, active in ((big, 116.83e9, 5.13e9), (small, 20.91e9, 3.61e9)):
        assert counts.param_count(cfg.teacher.model) == pytest.approx(total, rel=1e-3)
        active_card = counts.active_param_count(cfg.teacher.model) - embed(cfg)
        assert active_card == pytest.approx(active, rel=2e-3)
    for cfg, params in ((ds, 8.19e9), (big, 4.02e9), (small, 0.596e9)):
        s = cfg.student_model()
        assert s.family == "qwen3" and not s.mla and s.sliding_window is None
        assert not (s.attn_sinks or s.o_bias or s.n_experts) and s.activation == "silu"
        assert counts.param_count(s) == pytest.approx(params, rel=2e-3)


def test_the_deepseek_layout_s_figures():
    """61 layers in 2 stages of 31 (one zero layer pads the last), the experts over
    ep x tp = 8 on each host: 101 GiB of bfloat16 weights per GPU, 51.5 GiB were the
    released float8 matrices kept in float8; on one host (pp = 1) 168 GiB (each feed-forward
    stored only in its own layers), and 85 GiB in float8: what would fit one 8 x H200 host
    (docs/guides/model-families.md)."""
    cfg = load_config(DEEPSEEK)
    t = plan.teacher_figures(cfg)
    gib = 2**30
    assert (t["stages"], t["layers_per_stage"], t["microbatches"]) == (2, 31, 8)
    assert t["weight_bytes_per_device"] / gib == pytest.approx(101.3, abs=0.1)
    assert t["float8_weight_bytes_per_device"] / gib == pytest.approx(51.5, abs=0.1)
    one = plan.teacher_figures(load_config(DEEPSEEK, ["mesh.teacher.pp=1", "mesh.teacher.hosts=1"]))
    assert one["weight_bytes_per_device"] / gib == pytest.approx(168.2, abs=0.1)
    assert one["float8_weight_bytes_per_device"] / gib == pytest.approx(85.0, abs=0.1)
    assert "float8_weight_bytes_per_device" not in plan.teacher_figures(load_config(GPT_OSS_120B))


TINY_DEEPSEEK = dict(
    vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, d_ff=96, n_experts=8,
    experts_per_token=2, d_ff_expert=32, d_ff_shared=32, shared_expert_gate=False,
    dense_layers=(0,), kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True, router_score="sigmoid",
    router_correction_bias=True, n_group=4, topk_group=2, norm_topk_prob=True,
    routed_scale=2.5, family="deepseek_v3",
)  # fmt: skip
TINY_GPT_OSS = dict(
    vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=32,
    n_experts=8, experts_per_token=2, d_ff_expert=32, qkv_bias=True, o_bias=True,
    attn_sinks=True, router_bias=True, expert_bias=True, activation="swiglu_clamped",
    norm_topk_prob=True, family="gpt_oss",
)  # fmt: skip


@pytest.mark.parametrize("keys", [TINY_DEEPSEEK, TINY_GPT_OSS], ids=["deepseek_v3", "gpt_oss"])
def test_the_model_s_flops_are_the_compiled_forward_s(keys):
    """The teacher forward as `distill plan` compiles it (ep = 1, the plain attention math,
    every loop counted by its trip count) against `counts.flops_per_token`: within 5% (the
    grouped matmul's padded tiles), the MoE FLOPs check passing. DeepSeek's dense first
    layer is the cond's other branch, as costly as its MoE layers (d_ff = (k + shared) x
    F, as DeepSeek-V3's 18,432 = 9 x 2,048), so the stored-but-unused weights are not
    counted; latent attention's QK^T at nope + rope dims and PV at v_head_dim."""
    from pipelines.plan import flops as plan_flops

    tree = tiny_config("unused", "unused", mesh={"teacher": {"tp": 1}})
    tree["train"].update(batch_size=4, seq_len=128)
    tree["teacher"].update(dtype="float32", microbatch=4)
    tree["student"]["model"]["n_experts"] = 0
    cfg = config_from_dict(tree)
    cfg.teacher.model = ModelConfig(**keys, attention="reference")
    mem, _ = plan_memory.teacher_memory(cfg, teacher_mesh(jax.devices()[:1], 1, 1, 1), None)
    want = counts.flops_per_token(cfg.teacher.model, 128)
    assert mem["compiled_flops_per_token"] == pytest.approx(want, rel=0.05)
    plan_flops.check_moe(cfg, mem)


def test_sliding_layers_count_their_window_s_keys():
    """gpt-oss's 128-token sliding layers attend to 128 keys a query, not S: the plan's
    attention FLOPs count each layer's own keys."""
    full = ModelConfig(**TINY_GPT_OSS)
    mixed = full.model_copy(update={"sliding_window": 16, "layer_types": ("sliding", "full") * 2})
    h, widths = 4, 16 + 16
    assert counts.attention_flops_per_token(full, 128) == 2 * 4 * 128 * h * widths
    assert counts.attention_flops_per_token(mixed, 128) == 2 * (2 * 16 + 2 * 128) * h * widths
    assert counts.attention_flops_per_token(mixed, 8) == counts.attention_flops_per_token(full, 8)


def _plan(path: str, devices: int) -> dict:
    sets = ["mesh.platform=cpu", "teacher.dtype=float32", "train.remat=block"]
    argv = [sys.executable, "-m", "pipelines.commands.cli", "plan", path]
    argv += sum((["--set", s] for s in sets), [])
    done = subprocess.run(argv, env=cli_env(devices), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bf16_peak(t: dict) -> float:
    """A bfloat16 teacher's peak on a GPU from its float32 plan on CPU devices (which copy
    bfloat16 weight stacks to float32 for the matmuls): the weights halve, the temporaries
    do not grow (as tests/test_plan.py's 405B check)."""
    return t["peak_bytes_per_device"] - t["weight_bytes_per_device"] / 2


@pytest.mark.slow  # about 45 s on 2 cores: the 671B forward (16 devices) and the 8B step
def test_the_deepseek_v3_671b_layout_fits_h200s_planned_on_cpu():
    p = _plan(DEEPSEEK, 24)
    t, s = p["teacher"], p["student"]
    assert p["layout"]["teacher"]["shape"] == {"pp": 2, "dp": 1, "ep": 4, "tp": 2}
    assert t["params"] == pytest.approx(671.03e9, rel=1e-4)
    assert t["active_params"] == pytest.approx(37.55e9, rel=1e-3)
    assert t["compiled_flops_per_token"] <= 1.1 * t["forward_flops_per_token"]
    assert t["all_to_all_bytes_per_step"] > t["routed_bytes_per_step"] > 0
    assert _bf16_peak(t) < 141e9 * 0.9 and s["peak_bytes_per_device"] < 80e9


@pytest.mark.slow  # about 40 s on 2 cores
def test_the_gpt_oss_120b_layout_fits_80_gb_planned_on_cpu():
    p = _plan(GPT_OSS_120B, 8)
    t, s = p["teacher"], p["student"]
    assert p["layout"]["teacher"]["shape"] == {"dp": 1, "ep": 4, "tp": 1}
    assert _bf16_peak(t) < 80e9 * 0.9 and s["peak_bytes_per_device"] < 80e9


@pytest.mark.slow  # about 40 s on 2 cores
def test_the_gpt_oss_20b_colocated_layout_fits_one_80_gb_gpu_planned_on_cpu():
    p = _plan(GPT_OSS_20B, 1)
    assert p["layout"]["placement"] == "colocated"
    both = p["colocated"]["peak_bytes_per_device"] - p["teacher"]["weight_bytes_per_device"] / 2
    assert both < 80e9
