"""What `distill plan` counts for Qwen3.5 (`distill.models.counts` with the linear layers'
formulas in `distill.models.linear_attention`): parameters as transformers' model holds
them (each layer stores its own mixer's weights; pipeline stages' one-shape stack stores
both kinds, the other kind's unused zeros), the analytic FLOPs against the compiled
programs' matmuls, and the planned memory of linear layers growing linearly with the row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.compiled_flops import compiled_dot_flops
from distill.config import ModelConfig
from distill.config.load import config_from_dict
from distill.mesh import teacher_mesh
from distill.models import counts, hf, model, parts
from distill.models import linear_attention as la
from pipelines import plan
from pipelines.plan import memory as plan_memory
from tests.conftest import tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from teacher.hf import read_hf_layers  # noqa: E402
from tests.test_families import _save  # noqa: E402
from tests.test_qwen35 import COMMON, FAMILIES  # noqa: E402

HYBRID = dict(
    vocab_size=256, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
    attn_output_gate=True, qk_norm=True, norm_offset=1.0, attention="blockwise",
    linear_k_heads=2, linear_v_heads=4, linear_k_dim=128, linear_v_dim=128,
)  # fmt: skip
HYBRID_TYPES = ("linear", "linear", "linear", "full")


def _numel(m) -> int:
    return sum(p.numel() for p in m.parameters())


def test_params_are_transformers_and_the_unused_are_the_zeros(tmp_path):
    """The tiny model: `param_count` is transformers' parameter count and what the loaded
    tree stores (each layer only its own mixer's weights); in the one-shape stack pipeline
    stages hold (`parts.to_union`), the parameters it adds are exactly its zeros (the
    weights are random)."""
    ref = _save(tmp_path, "qwen3_5_text", FAMILIES, COMMON)
    cfg = hf.read_model_config(tmp_path)
    assert counts.param_count(cfg) == _numel(ref)
    params = read_hf_layers(tmp_path, cfg, list(range(cfg.n_layers)))
    leaves = jax.tree.leaves(params)
    assert sum(x.size for x in leaves) == counts.stored_param_count(cfg) == _numel(ref)
    assert counts.unused_param_count(cfg) == 0
    union = jax.tree.leaves(parts.to_union(cfg, params))
    assert sum(x.size for x in union) == counts.stored_param_count(cfg, union=True)
    zeros = sum(int(np.sum(np.asarray(x) == 0)) for x in union)
    assert zeros == counts.unused_param_count(cfg, union=True) > 0


def test_params_at_the_default_size_are_transformers(tmp_path):
    """transformers' default Qwen3_5TextConfig (32 layers of width 4096, 24 linear), its
    model built on the meta device: 8.95B parameters, counted alike."""
    hf_cfg = transformers.Qwen3_5TextConfig()
    with torch.device("meta"):
        m = transformers.Qwen3_5ForCausalLM(hf_cfg)
    hf_cfg.save_pretrained(tmp_path)
    cfg = hf.read_model_config(tmp_path)
    assert counts.param_count(cfg) == _numel(m) == 8_953_803_264
    t = plan.teacher_figures(config_from_dict(tiny_config("x", "y", teacher={"model": cfg})))
    assert t["params"] == _numel(m) and "unused_params" not in t  # none stored at pp=1


@pytest.fixture
def on_gpu(monkeypatch):
    """Programs built as for a GPU (`attention.platform`): the rule's triangular solve,
    where a CPU build inverts by squarings (`linear_attention.solve_unit_lower`)."""
    from distill.models import attention

    monkeypatch.setattr(attention, "_platform", "gpu")


@pytest.mark.parametrize("s, h, dk, dv", [(1024, 4, 64, 64), (4096, 2, 128, 128)])
def test_chunked_rule_compiled_flops_near_analytic(s, h, dk, dv, on_gpu):
    """The compiled chunked rule's matmuls (`distill.compiled_flops`: the chunk scan by its
    trip count) against `rule_flops`: 0.86 and 0.90 (the triangular solve, 10-14% of the
    analytic count, is no dot)."""
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (spec(1, s, h, dk), spec(1, s, h, dk), spec(1, s, h, dv), spec(1, s, h), spec(1, s, h))
    compiled = jax.jit(la.gated_delta_rule).lower(*args).compile()
    ratio = compiled_dot_flops(compiled) / la.rule_flops(1, s, h, dk, dv)
    assert 0.8 <= ratio <= 1.0, ratio


@pytest.mark.parametrize("types", [("linear",) * 4, HYBRID_TYPES])
def test_model_flops_per_token_near_the_compiled_forward(types, on_gpu):
    """`counts.flops_per_token` of a linear and a hybrid model (LM head left out) against
    the compiled forward's matmuls at 2,048 positions, built as for a GPU: 0.97 and 0.89
    (blockwise attention's data-bounded loop counted once), within 1.5x."""
    cfg = ModelConfig(**HYBRID, layer_types=types)
    s = 2048
    ids = jax.ShapeDtypeStruct((1, s), jnp.int32)
    forward = jax.jit(lambda p, t, g, q: model.apply_hidden(cfg, p, t, g, q)[0])
    compiled = forward.lower(model.abstract_params(cfg), ids, ids, ids).compile()
    want = counts.flops_per_token(cfg, s) - 2 * cfg.d_model * cfg.vocab_size
    ratio = compiled_dot_flops(compiled) / s / want
    assert 1 / 1.5 <= ratio <= 1.5, ratio


def test_linear_layers_plan_memory_linear_in_the_row():
    """The teacher forward's compiled temporaries at 1,024, 2,048 and 4,096 positions of a
    hybrid model double with the row (never S x S)."""
    temps = []
    for seq in (1024, 2048, 4096):
        tree = tiny_config("x", "y", train={"seq_len": seq, "batch_size": 2})
        tree["teacher"].update(model={**HYBRID, "d_model": 64, "d_ff": 128}, microbatch=2)
        tree["teacher"]["model"]["layer_types"] = list(HYBRID_TYPES)
        tree["mesh"] = {"teacher": {"tp": 1}, "student": {"dp": 1}}
        cfg = config_from_dict(tree)
        cfg.resolve_dtypes("cpu")
        mesh = teacher_mesh(jax.devices()[:1], 1, 1)
        figures, _ = plan_memory.teacher_memory(cfg, mesh, None)
        temps.append(figures["forward_temp_bytes_per_device"])
    for a, b in zip(temps, temps[1:], strict=False):
        assert 1.8 <= b / a <= 2.2, temps


def test_the_shipped_qwen35_layout_is_transformers_default_mixture():
    """pipelines/qwen3.5-35b-a3b-to-4b-chat.yaml: its teacher is transformers' default
    Qwen3_5MoeTextConfig (Qwen3.5-35B-A3B), counted alike (34.66B, built on the meta
    device); its dense student keeps the hybrid pattern (a full layer every fourth) and
    its width is what the YAML's comments say."""
    from distill.config.load import load_config

    cfg = load_config("pipelines/qwen3.5-35b-a3b-to-4b-chat.yaml")
    with torch.device("meta"):
        m = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig())
    t = cfg.teacher.model
    assert counts.param_count(t) == _numel(m) == pytest.approx(34.66e9, rel=1e-3)
    s = cfg.student_model()
    assert s.family == "qwen3_5_text" and not s.n_experts
    assert s.types() == ("linear", "linear", "linear", "full") * 8
    ref = transformers.Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=2560, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, intermediate_size=9216, tie_word_embeddings=True,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128,
    )  # fmt: skip
    with torch.device("meta"):
        m = transformers.Qwen3_5ForCausalLM(ref)
    assert counts.param_count(s) == _numel(m) == pytest.approx(4.21e9, rel=2e-3)


def test_the_shipped_qwen35_layout_validates_with_its_downloads_in_place(
    tmp_path, monkeypatch, capsys
):
    """With the teacher's tokenizer and chat data in place (tiny stand-ins here), `validate`
    checks everything the file sets: the teacher's directory without its weights is named
    as such; with no teacher directory (its tokenizer elsewhere), the one line `run` stops
    at: the 35B teacher cannot be bootstrapped on this machine."""
    import json

    from pipelines.commands.cli import main
    from tests.test_chat import train_bpe
    from tests.test_chat_templates import SPECIALS
    from tests.test_chat_templates import model_dir as chat_model_dir
    from tests.test_tutorial import ROOT, _conversations

    texts = [m["content"] for c in _conversations(20) for m in c["messages"]] * 10
    bpe = tmp_path / "bpe.json"
    train_bpe(texts, SPECIALS, 320).save(str(bpe))
    chat_model_dir(tmp_path / "models" / "Qwen3.5-35B-A3B", bpe, "qwen3")
    chat_model_dir(tmp_path / "models" / "tokenizer", bpe, "qwen3")
    (tmp_path / "data").mkdir()
    lines = (json.dumps(c) + "\n" for c in _conversations(3000))  # 32 rows of 4,096 tokens
    (tmp_path / "data" / "chat.jsonl").write_text("".join(lines))
    monkeypatch.chdir(tmp_path)
    path = ROOT / "pipelines" / "qwen3.5-35b-a3b-to-4b-chat.yaml"
    rc = main(["validate", str(path), "--set", "mesh.platform=cpu"])
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("distill: error:")]
    assert rc == 2 and "holds neither a Hugging Face checkpoint" in line, err
    sets = ["--set", "teacher.checkpoint=models/none", "--set", "data.tokenizer=models/tokenizer"]
    rc = main(["validate", str(path), "--set", "mesh.platform=cpu", *sets])
    out = capsys.readouterr().out
    assert rc == 0 and f"{path}: ok (" in out, out
    assert f"{path}: not runnable on this machine: teacher.checkpoint: no weights at " in out
    assert "34.7B-parameter teacher (teacher.pretrain_steps) needs" in out, out
