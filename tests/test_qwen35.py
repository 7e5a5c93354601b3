"""Qwen3.5 text (`qwen3_5_text`) in the one model: a tiny transformers model (three linear
attention layers and a full one, random O(1) weights) read by distill's loader gives
transformers' log-probabilities on the teacher's mesh at tp=1 and tp=2 (the linear layers'
heads split too) and as the single-device student, on a packed batch (each document
compared with transformers run on it alone)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distill.models import hf, model  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.hf import load_hf_teacher, read_hf_layers  # noqa: E402
from tests.test_families import (  # noqa: E402
    _logprobs,
    _save,
    assert_documents_match,
    packed_batch,
    per_document_logprobs,
)
from tests.test_hf import _mesh  # noqa: E402

COMMON = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
)  # fmt: skip
FAMILIES = {"qwen3_5_text": ("Qwen3_5", "Qwen3_5TextConfig", {})}


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35")
    ref = _save(path, "qwen3_5_text", FAMILIES, COMMON)
    batch = packed_batch()
    return path, ref, per_document_logprobs(ref, batch), batch


def test_config_reads_layer_types_and_linear_shapes(qwen35):
    path, ref, _, _ = qwen35
    cfg = hf.read_model_config(path)
    assert cfg.types() == ("linear", "linear", "linear", "full")
    assert (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim) == (2, 4, 8)
    assert cfg.rope_dim == 4 and cfg.attn_output_gate and cfg.norm_offset == 1.0


@pytest.mark.parametrize("tp", [1, 2])
def test_teacher_logprobs_match_transformers(qwen35, tp):
    path, _, want, batch = qwen35
    cfg = hf.read_model_config(path)
    params = load_hf_teacher(path, cfg, _mesh(tp))
    got = make_forward(cfg, _mesh(tp), mode="logits")(params, batch)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=str(tp))


def test_student_model_matches_transformers(qwen35):
    path, _, want, batch = qwen35
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    got = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg="student")


def test_export_round_trip(qwen35, tmp_path):
    """`student.export.write_hf` of the model read from the checkpoint: transformers loads
    it as Qwen3_5ForCausalLM (in_proj_qkv and conv1d fused again) with the original's
    log-probs, and it reads back as the same config."""
    from student.export import write_hf

    path, ref, want, batch = qwen35
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    out = write_hf(tmp_path / "export", cfg, params, max_position_embeddings=64)
    got = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(got) is type(ref)
    logp = per_document_logprobs(got, batch)
    assert_documents_match(logp, want, batch, atol=2e-5, rtol=1e-5, err_msg="export")
    assert hf.read_model_config(out) == cfg
