"""Gemma 4 text (`gemma4_text`) in the one model: a tiny transformers `Gemma4ForCausalLM`
(float32, six layers: two sliding then a full, twice; the full layers' heads twice as
wide, `global_head_dim`, and with `attention_k_eq_v` one KV head of their own and values
from the keys' projection; random O(1) weights, each layer's `layer_scalar` too) read by
distill's loader gives transformers' log-probabilities on a packed batch (each document
against transformers run on it alone) as the teacher at tp = 1, 2 and 4 (at 4 the KV heads
replicated over shards) and as the single-device student."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distill.errors import DistillError  # noqa: E402
from distill.models import counts, hf, model  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.hf import load_hf_teacher, read_hf_layers  # noqa: E402
from tests.test_families import (  # noqa: E402
    WINDOW,
    _edit,
    _logprobs,
    assert_documents_match,
    packed_batch,
    per_document_logprobs,
)
from tests.test_hf import _mesh  # noqa: E402

TYPES = ["sliding_attention"] * 2 + ["full_attention"]
COMMON = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
    sliding_window=WINDOW, layer_types=TYPES * 2, hidden_size_per_layer_input=0,
    rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
CASES = {  # name: config keys beyond COMMON
    # full layers: one KV head of their own, values = the keys' projection; a final soft-cap
    "k_eq_v_softcap": dict(
        attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=3.0
    ),
    # full layers wider only; untied head; the RoPE bases and proportion set
    "wide_full_untied": dict(
        tie_word_embeddings=False,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 1e4,
            },
        },
    ),  # fmt: skip
}


def save_gemma4(path, keys: dict):
    """A tiny `Gemma4ForCausalLM` of COMMON and `keys` saved at `path`: random O(1)
    weights, norms near 1, each layer's scalar buffer drawn in [0.5, 1.5]; read back in
    float32 with eager attention."""
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(**{**COMMON, **keys})
    m = transformers.Gemma4ForCausalLM(config)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.3)
        for name, b in m.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    m.save_pretrained(str(path))
    ref = type(m).from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return ref.eval()


@pytest.fixture(scope="module", params=list(CASES))
def gemma4(request, tmp_path_factory):
    """(name, directory, transformers' model, its per-document log-probs, the batch)."""
    path = tmp_path_factory.mktemp(request.param)
    ref = save_gemma4(path, CASES[request.param])
    batch = packed_batch()
    return request.param, path, ref, per_document_logprobs(ref, batch), batch


def test_config_reads_the_full_layers_shapes(gemma4):
    name, path, ref, _, _ = gemma4
    cfg = hf.read_model_config(path)
    assert cfg.family == "gemma4_text" and cfg.types() == ("sliding", "sliding", "full") * 2
    assert (cfg.hd, cfg.kind_hd("full"), cfg.global_head_dim) == (8, 16, 16)
    k_eq_v = name == "k_eq_v_softcap"
    assert cfg.attn_k_eq_v == k_eq_v and cfg.kind_kv_heads("full") == (1 if k_eq_v else 2)
    assert cfg.norm_offset == 0 and cfg.scale() == 1.0 and cfg.v_norm and cfg.layer_scalar
    assert cfg.full_apart() and cfg.rope_proportional
    assert cfg.tie_embeddings == ref.config.tie_word_embeddings
    buffers = sum(b.numel() for n, b in ref.named_buffers() if n.endswith("layer_scalar"))
    assert counts.param_count(cfg) == sum(p.numel() for p in ref.parameters()) + buffers


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_teacher_logprobs_match_transformers(gemma4, tp):
    name, path, _, want, batch = gemma4
    cfg = hf.read_model_config(path)
    params = load_hf_teacher(path, cfg, _mesh(tp))
    got = make_forward(cfg, _mesh(tp), mode="logits")(params, batch)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4,
                           err_msg=f"{name} tp={tp}")  # fmt: skip


@pytest.mark.parametrize("attention", ["reference", "blockwise", "prefix"])
def test_student_model_matches_transformers(gemma4, attention):
    name, path, _, want, batch = gemma4
    cfg = hf.read_model_config(path).model_copy(update={"attention": attention})
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    assert params["layers"]["full_wk"].shape[0] == 2  # the full layers' own stack
    got = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(hidden_size_per_layer_input=8), "hidden_size_per_layer_input=8"),
        (dict(num_kv_shared_layers=2), "num_kv_shared_layers=2"),
        (dict(enable_moe_block=True), "enable_moe_block=True"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
        (dict(per_layer_config={"0": {"head_dim": 16}}), r"per_layer_config\[0\]"),
    ],
)
def test_what_it_cannot_run_is_one_line_naming_the_key(tmp_path, changes, match):
    src = tmp_path / "src"
    save_gemma4(src, CASES["k_eq_v_softcap"])
    bad = _edit(src, tmp_path / "bad", **changes)
    with pytest.raises(DistillError, match=rf"config.json: {match}"):
        hf.read_model_config(bad)


def test_global_head_dim_keys_read_as_per_layer_config(gemma4, tmp_path):
    """The released checkpoints' keys (`global_head_dim`, `num_global_key_value_heads`)
    and transformers 5.25's `per_layer_config` read as the same model."""
    name, path, ref, _, _ = gemma4
    cfg = hf.read_model_config(path)
    released = dict(per_layer_config=None, global_head_dim=16)
    if name == "k_eq_v_softcap":
        released["num_global_key_value_heads"] = 1
    other = _edit(path, tmp_path / "released", **released)
    assert hf.read_model_config(other) == cfg
