"""Hugging Face Llama: a teacher loaded into the TP layout gives transformers' logits; an
HF directory sets teacher.model; bad directories fail preflight naming the file; the
exported student loads in transformers with distill's logits and tokens."""

import json
import shutil

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from distill.checkpoint import Checkpointer  # noqa: E402
from distill.config import ModelConfig  # noqa: E402
from distill.config.load import config_from_dict  # noqa: E402
from distill.data.tokenizers import ByteTokenizer  # noqa: E402
from distill.errors import DistillError  # noqa: E402
from distill.mesh import teacher_mesh  # noqa: E402
from distill.models import hf, model, rope  # noqa: E402
from distill.types import Batch  # noqa: E402
from pipelines.commands.cli import main  # noqa: E402
from pipelines.preflight import check_shapes  # noqa: E402
from student import optim, train  # noqa: E402
from student.export import write_hf  # noqa: E402
from teacher import sharding  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.hf import load_hf_teacher  # noqa: E402
from teacher.weights import load_teacher  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # puts head_dim 16's wavelengths in all 3 bands
}


def _save_llama(path, *, torch_dtype=torch.float32, max_shard_size=None, arch="Llama", **overrides):
    """A random {arch}ForCausalLM saved as safetensors; returns it reloaded in float32."""
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(**{**kw, **overrides})
    m = getattr(transformers, f"{arch}ForCausalLM")(config)
    with torch.no_grad():  # O(1) weights and non-unit norms, so every mapping shows in logits
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.3)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    m.to(torch_dtype).save_pretrained(str(path), **extra)
    # reloaded rather than upcast, so RoPE frequencies are float32 as in a fresh load
    return type(m).from_pretrained(str(path), torch_dtype=torch.float32).eval()


def _hf_logits(m, tokens):
    with torch.no_grad():
        return m(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _batch(vocab, b=2, s=20):
    tokens = np.random.default_rng(1).integers(0, vocab, (b, s)).astype(np.int32)
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    return Batch(tokens, tokens, np.ones_like(tokens), pos, np.ones((b, s), np.float32))


def _mesh(tp, dp=1):
    return teacher_mesh(jax.devices()[: dp * tp], dp, tp)


CASES = {  # name: (tp, save_llama kwargs)
    "gqa_kv_below_tp": (4, dict(rms_norm_eps=1e-6)),
    "kv_at_tp_tied_theta_sharded_files": (
        4,
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_theta=5e5,
            rms_norm_eps=1e-5,
            max_shard_size="20KB",
        ),
    ),
    "mqa_head_dim_llama3_rope": (
        2,
        dict(vocab_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=16)
        | dict(rope_scaling=LLAMA3),
    ),
    "bfloat16_linear_rope": (
        2,
        dict(
            num_key_value_heads=8,
            torch_dtype=torch.bfloat16,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
    ),
    "mistral_without_sliding_window": (2, dict(arch="Mistral", sliding_window=None)),
}


@pytest.mark.parametrize("name", CASES)
def test_teacher_from_hf_matches_transformers(tmp_path, name):
    tp, kw = CASES[name]
    ref_model = _save_llama(tmp_path, **kw)
    if "max_shard_size" in kw:
        assert (tmp_path / hf.INDEX_FILE).is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    cfg = hf.read_model_config(tmp_path)
    mesh = _mesh(tp)
    params = load_hf_teacher(tmp_path, cfg, mesh)
    specs = jax.tree.map(lambda s: s.spec, sharding.shardings(cfg, mesh))
    assert jax.tree.map(lambda x: x.sharding.spec, params) == specs
    stored = torch.bfloat16 if kw.get("torch_dtype") == torch.bfloat16 else torch.float32
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {str(stored).split(".")[1]}
    if cfg.rope_scaling is not None:
        inv_freq = ref_model.model.rotary_emb.inv_freq.numpy()
        ours = rope.rope_frequencies(cfg.hd, cfg.rope_theta, cfg.rope_scaling)
        np.testing.assert_allclose(ours, inv_freq, rtol=1e-6)

    batch = _batch(cfg.vocab_size)
    ours = np.asarray(make_forward(cfg, mesh, mode="logits")(params, batch))
    np.testing.assert_allclose(ours, _hf_logits(ref_model, batch.tokens), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def hf_teacher(tmp_path_factory):
    """A byte-vocabulary (260 ids) HF Llama teacher directory."""
    path = tmp_path_factory.mktemp("hf_teacher")
    _save_llama(path, vocab_size=260, num_attention_heads=4, num_key_value_heads=2)
    return path


def _cfg_tree(corpus_dir, out, teacher_dir, **teacher):
    tree = tiny_config(str(corpus_dir), str(out))
    tree["teacher"] = {"checkpoint": str(teacher_dir), "top_k": 8, **teacher}
    return tree


def test_hf_dir_sets_teacher_model(hf_teacher, corpus_dir, tmp_path):
    cfg = config_from_dict(_cfg_tree(corpus_dir, tmp_path, hf_teacher))
    assert cfg.teacher.is_hf()
    assert cfg.teacher.model == hf.read_model_config(hf_teacher)
    assert cfg.teacher.model.d_model == 32 and cfg.teacher.model.norm_eps == 1e-6
    assert cfg.student_model().vocab_size == 260  # the student inherits the HF vocabulary
    # keys that agree with config.json may stay; a disagreeing one is an error naming the file
    config_from_dict(_cfg_tree(corpus_dir, tmp_path, hf_teacher, model={"d_model": 32}))
    with pytest.raises(DistillError, match=r"teacher.model.d_model: 64 .*config.json"):
        config_from_dict(_cfg_tree(corpus_dir, tmp_path, hf_teacher, model={"d_model": 64}))
    with pytest.raises(DistillError, match=r"config.json not found"):
        config_from_dict(_cfg_tree(corpus_dir, tmp_path, tmp_path, format="hf"))
    plain = config_from_dict(_cfg_tree(corpus_dir, tmp_path, hf_teacher, format="distill"))
    assert not plain.teacher.is_hf()


@pytest.mark.parametrize("dp", [1, 2])
def test_load_teacher_dispatches_to_hf(hf_teacher, corpus_dir, tmp_path, dp):
    """On a dp x tp inference mesh too: the weights replicated over dp, each dp group
    running its own rows."""
    cfg = config_from_dict(_cfg_tree(corpus_dir, tmp_path, hf_teacher))
    mesh = _mesh(2, dp)
    params = load_teacher(cfg, mesh)
    assert params["layers"]["wq"].sharding.spec == P(None, None, "tp")
    assert params["layers"]["wq"].sharding.mesh.shape == {"dp": dp, "ep": 1, "tp": 2}
    batch = _batch(260, b=2, s=8)
    ref = _hf_logits(transformers.LlamaForCausalLM.from_pretrained(str(hf_teacher)), batch.tokens)
    out = make_forward(cfg.teacher.model, mesh, mode="logits")(params, batch)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4, rtol=1e-4)


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **changes}))
    return dst


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(model_type="phi3"), "model_type 'phi3'"),
        (dict(attention_bias=True), "attention_bias=True is not supported"),
        (
            dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}),
            "RoPE type 'longrope'",
        ),
    ],
)
def test_unsupported_hf_configs_name_the_file(hf_teacher, tmp_path, changes, match):
    bad = _edit_config(hf_teacher, tmp_path / "bad", **changes)
    with pytest.raises(DistillError, match=rf"{bad / 'config.json'}: .*{match}"):
        hf.read_model_config(bad)


def test_preflight_checks_the_hf_directory(hf_teacher, corpus_dir, tmp_path):
    tree = _cfg_tree(corpus_dir, tmp_path, hf_teacher)
    tree["mesh"]["teacher"]["tp"] = 8  # 260 ids do not split 8 ways
    with pytest.raises(DistillError, match=r"config.json: vocab_size=260 is not divisible"):
        check_shapes(config_from_dict(tree))

    missing = _edit_config(hf_teacher, tmp_path / "missing")
    (missing / hf.SINGLE_FILE).unlink()
    with pytest.raises(DistillError, match="neither model.safetensors nor"):
        check_shapes(config_from_dict(_cfg_tree(corpus_dir, tmp_path, missing)))

    wrong = _edit_config(hf_teacher, tmp_path / "wrong", intermediate_size=48)
    with pytest.raises(DistillError, match=r"mlp.gate_proj.weight has shape \(64, 32\)"):
        check_shapes(config_from_dict(_cfg_tree(corpus_dir, tmp_path, wrong)))


SCALED = {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    "overrides",
    [
        dict(n_kv_heads=2, tie_embeddings=False),
        dict(n_kv_heads=1, tie_embeddings=True, rope_theta=5e5, head_dim=16, rope_scaling=SCALED),
    ],
)
def test_export_round_trip(tmp_path, overrides):
    base = dict(vocab_size=260, d_model=32, n_layers=2, n_heads=4, d_ff=64, norm_eps=1e-6)
    cfg = ModelConfig(**base, **overrides)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape, np.float32),
        model.init_params(cfg, 0),
    )
    out = write_hf(tmp_path / "hf", cfg, params, max_position_embeddings=64)
    # 260 is padded past the byte tokenizer's 259 ids: the export trims the padded id
    live = ByteTokenizer.vocab_size
    assert hf.read_model_config(out) == cfg.model_copy(update={"vocab_size": live})

    text = "distil héllo ✓\n"
    ids = [ByteTokenizer.bos_id, *ByteTokenizer().encode(text).tolist()]
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok(text).input_ids == ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.eos_token_id, tok.pad_token_id) == (ByteTokenizer.eos_id, ByteTokenizer.pad_id)

    tokens = np.array([ids], np.int32)
    pos = np.arange(len(ids), dtype=np.int32)[None]
    ours = np.asarray(model.apply(cfg, params, tokens, np.ones_like(tokens), pos))[..., :live]
    ref = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    np.testing.assert_allclose(ours, _hf_logits(ref, tokens), atol=1e-4, rtol=1e-4)


def test_run_with_hf_teacher_then_export(hf_teacher, corpus_dir, tmp_path, capsys):
    """`distill run` on-policy with an HF teacher (it scores the student's samples), then
    `distill export`: transformers loads the student and gives the logits of distill's
    student checkpoint."""
    out = tmp_path / "out"
    tree = _cfg_tree(corpus_dir, out, hf_teacher)
    tree["train"].update(steps=2, eval_every=2, checkpoint_every=2, log_every=2)
    tree.setdefault("distill", {})["on_policy"] = {"fraction": 1.0, "max_new_tokens": 4}
    tree["distill"]["alpha_gate"] = False  # a random teacher: the gate would close at step 0
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert main(["run", str(path)]) == 0
    assert not (out / "teacher").exists()  # nothing bootstrapped: the HF weights were used
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["on_policy"] for r in lines if r.get("phase") == "distill" and "loss" in r] == [1.0]
    assert all(r["sample_kl"] == r["sample_kl"] for r in lines if r.get("eval"))  # not NaN
    capsys.readouterr()

    assert main(["export", str(out), "--format", "hf"]) == 0
    exported = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["export"]
    assert exported == str(out / "hf")
    cfg = config_from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    scfg = cfg.student_model()
    live = ByteTokenizer.vocab_size  # the padded 260th id is trimmed on export
    assert hf.read_model_config(exported) == scfg.model_copy(update={"vocab_size": live})

    ckpt = Checkpointer(str(out / "checkpoints"))
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps)
    state, _, step = ckpt.restore(train.saved(train.abstract_state(scfg, tx, _mesh(1))))
    ckpt.close()
    assert step == 2
    batch = _batch(live, b=1, s=12)
    ours = model.apply(scfg, state.params, batch.tokens, batch.segment_ids, batch.positions)
    student = transformers.LlamaForCausalLM.from_pretrained(exported).eval()
    np.testing.assert_allclose(
        np.asarray(ours)[..., :live], _hf_logits(student, batch.tokens), atol=1e-4
    )

    # in bfloat16 and in shards (a tiny shard size): transformers loads the index
    half = tmp_path / "hf16"
    args = ["--dtype", "bfloat16", "--max-shard-gb", "0.00002", "--out", str(half)]
    assert main(["export", str(out), *args]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dtype"] == "bfloat16"
    index = json.loads((half / hf.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (half / hf.SINGLE_FILE).exists()
    student16 = transformers.LlamaForCausalLM.from_pretrained(str(half), dtype=torch.float32)
    assert next(iter(student16.state_dict().values())).dtype == torch.float32
    np.testing.assert_allclose(
        _hf_logits(student16.eval(), batch.tokens), _hf_logits(student, batch.tokens), atol=0.1
    )

    with pytest.raises(SystemExit):
        main(["export", str(out), "--format", "onnx"])
    assert main(["export", str(tmp_path / "nowhere")]) == 2
    assert main(["export", str(out), "--max-shard-gb", "0"]) == 2


def test_load_benchmark_script_runs(tmp_path):
    """`python -m teacher.load_bench` on a tiny generated checkpoint: sharded as asked,
    every byte on the devices, memory figures present."""
    from teacher import load_bench

    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=128)
    sizes = load_bench.write_checkpoint(tmp_path, cfg, shard_bytes=40_000)
    assert sizes["shards"] > 2 and (tmp_path / hf.INDEX_FILE).is_file()
    assert sizes["largest_shard_bytes"] <= max(40_000, 2 * 256 * 64)  # one tensor may exceed
    result = load_bench.load_child(str(tmp_path), tp=2)
    assert result["device_bytes"] == sizes["checkpoint_bytes"]
    assert result["load_s"] > 0 and result["peak_rss_above_start_bytes"] >= 0


@pytest.mark.parametrize(
    "torch_dtype, held", [(torch.float32, "bfloat16"), (torch.bfloat16, "float32")]
)
def test_plan_counts_the_teacher_weights_as_held(corpus_dir, tmp_path, capsys, torch_dtype, held):
    """`distill plan`: an HF teacher's weights are converted once, as they are read, to
    teacher.dtype (the compute dtype) and held so, whatever dtype they were stored in."""
    _save_llama(tmp_path / "t", torch_dtype=torch_dtype, vocab_size=260, num_attention_heads=4)
    tree = _cfg_tree(corpus_dir, tmp_path / "out", tmp_path / "t", dtype=held)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert main(["plan", str(path)]) == 0
    teacher = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["teacher"]
    itemsize = 2 if held == "bfloat16" else 4
    assert teacher["weight_bytes_per_device"] == teacher["params"] * itemsize // 2  # tp=2


def test_export_config_of_a_head_dim_equal_to_the_default_width():
    """head_dim set to d_model / n_heads is the same model as head_dim unset: it exports
    (its config.json says 64, read back as None) rather than failing the round trip."""
    from distill.models.hf import export as hf_config

    cfg = ModelConfig(d_model=128, n_heads=2, n_kv_heads=2, head_dim=64, d_ff=256)
    raw = hf_config.to_hf_config(cfg, max_position_embeddings=512)
    assert raw["head_dim"] == 64
    assert hf.model_config_from_raw(raw, "config.json").hd == 64
