"""The 2026 mixture teachers through the commands a user runs, from their files as
released: a DeepSeek-V3-shaped teacher (latent attention, group-limited sigmoid routing,
shared experts, a dense first layer) stored in block float8 as DeepSeek's files are, and
its float32 dequantized twin. `distill run` at tp x ep and in pp stages with ep gives the
twin's losses (the float8 file read tensor by tensor into each layout), with the teacher's
expert load in the records; `distill score` equals transformers' log-probs of the twin;
`cache-teacher` and the cached run give the online run's losses; on-policy steps score the
student's samples with it."""

import json
import shutil

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight  # noqa: E402

from distill.data.tokenizers import ByteTokenizer  # noqa: E402
from pipelines.commands.cli import main  # noqa: E402
from teacher import quantized  # noqa: E402
from tests.conftest import read_train, tiny_config, train_by_step  # noqa: E402
from tests.test_families_moe_2026 import DEEPSEEK  # noqa: E402
from tests.test_hf import _hf_logits  # noqa: E402
from tests.test_quantized import FP8_CONFIG, quantize_fp8  # noqa: E402

# the byte tokenizer's 260 ids; d_model 160 and expert width 144 cut partial 128-blocks
TEACHER = {**DEEPSEEK, "vocab_size": 260, "hidden_size": 160, "moe_intermediate_size": 144}
LINEAR = ("proj.weight", "_a_proj_with_mqa.weight")  # the Linear weights DeepSeek quantizes


def _quantized_name(name: str) -> bool:
    """Whether DeepSeek's released files hold `name` in float8: every Linear weight of the
    layers (attention, dense and expert MLPs) but the router; embeddings, norms, head not."""
    return name.startswith("model.layers.") and name.endswith(LINEAR) and ".gate." not in name


def _std(shape) -> float:
    """O(1) activations whatever a matrix's input width (0.3 at 32, the test families')."""
    return 0.3 * (32 / shape[-1]) ** 0.5 if len(shape) > 1 else 0.3


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """(float8 dir, float32 twin dir, the twin as transformers loads it): a random model
    saved by transformers (the released per-expert tensor names), its Linear weights then
    stored as DeepSeek stores them, and the twin holding their dequantization."""
    root = tmp_path_factory.mktemp("deepseek_fp8")
    torch.manual_seed(0)
    m = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TEACHER))
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, _std(p.shape))
        for name, b in m.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 1.0)
    saved, fp8_dir, f32_dir = root / "saved", root / "fp8", root / "f32"
    m.save_pretrained(str(saved))
    rng = np.random.default_rng(0)
    fp8, f32 = {}, {}
    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118  (a safetensors file, not a dict)
            t = f.get_tensor(name).float()
            if _quantized_name(name):
                w = rng.standard_normal(tuple(t.shape)).astype(np.float32) * _std(t.shape)
                q, s = quantize_fp8(w)
                fp8[name], fp8[name + "_scale_inv"] = q, s
                f32[name] = _dequantize_fp8_weight(q, s, [128, 128], torch.float32)
            else:
                fp8[name] = f32[name] = t
    for sub, tensors in ((fp8_dir, fp8), (f32_dir, f32)):
        sub.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(sub / "model.safetensors"))
        shutil.copy(saved / "config.json", sub / "config.json")
    raw = json.loads((fp8_dir / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps({**raw, "quantization_config": FP8_CONFIG}))
    assert quantized.quantized_shapes(fp8_dir) and not quantized.quantized_shapes(f32_dir)
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(f32_dir), dtype=torch.float32, attn_implementation="eager"
    )
    return fp8_dir, f32_dir, ref.eval()


def _tree(corpus_dir, out, teacher_dir, **teacher_mesh) -> dict:
    tree = tiny_config(str(corpus_dir), str(out))
    tree["teacher"] = {"checkpoint": str(teacher_dir), "top_k": 8, "dtype": "float32"}
    tree["mesh"]["teacher"] = {"tp": 2, **teacher_mesh}
    # a Qwen3-shaped student of its own family: nothing of the latent attention inherited
    tree["student"]["model"].update(family="qwen3", vocab_size=260, head_dim=8, qk_norm=True)
    tree["train"].update(steps=4, log_every=1, eval_every=2, checkpoint_every=4)
    tree["distill"] = {"alpha_gate": False}  # a random teacher: every step distils
    return tree


def _run(tmp_path, tree, name="cfg.yaml") -> None:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree))
    assert main(["run", str(path)]) == 0


@pytest.mark.parametrize("axes", [{"ep": 2}, {"tp": 1, "ep": 2, "pp": 2}])
def test_a_float8_teacher_runs_as_its_dequantized_twin(teachers, corpus_dir, tmp_path, axes):
    """A run from the float8 files equals the run from their float32 dequantization, step
    by step, at tp x ep and in two stages with ep (3 layers: 2 and 1 and a zero layer); the
    records carry the teacher's expert load over its 8 experts."""
    fp8, f32, _ = teachers
    for sub, path in (("fp8", fp8), ("f32", f32)):
        _run(tmp_path, _tree(corpus_dir, tmp_path / sub, path, **axes), f"{sub}.yaml")
    got, want = train_by_step(tmp_path / "fp8"), train_by_step(tmp_path / "f32")
    assert sorted(got) == [1, 2, 3, 4]
    for step, r in want.items():
        for key in ("loss", "kd_loss", "ce_loss", "grad_norm"):
            assert got[step][key] == pytest.approx(r[key], rel=1e-6, abs=1e-7), (step, key)
    loads = [r["expert_load"] for r in read_train(tmp_path / "fp8") if "expert_load" in r]
    assert loads and all(len(x) == 8 and sum(x) == pytest.approx(1.0) for x in loads)


def test_score_of_a_float8_teacher_matches_transformers(teachers, corpus_dir, tmp_path, capsys):
    """`distill score --model teacher` (tp=2) of the float8 files: transformers' log-probs
    of their dequantized twin over the tokenizer's ids (the model's 260 pad the byte
    tokenizer's: masked, as in training)."""
    fp8, _, ref = teachers
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_tree(corpus_dir, tmp_path / "out", fp8)))
    text = tmp_path / "held_out.txt"
    text.write_text("The teacher keeps its experts in float8. ñ€ bytes too.\n")
    capsys.readouterr()
    assert main(["score", str(path), "--file", str(text), "--model", "teacher", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = got["tokens"]
    z = torch.tensor(_hf_logits(ref, np.array([ids])))[0, :, : ByteTokenizer.vocab_size]
    want = torch.log_softmax(z, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(got["logprobs"], want, atol=1e-4)


def test_cache_of_a_float8_teacher_gives_the_online_losses(teachers, corpus_dir, tmp_path):
    """`cache-teacher` from the float8 files at tp x ep, then the cached run: the online
    run's losses."""
    fp8, _, _ = teachers
    online = _tree(corpus_dir, tmp_path / "online", fp8, ep=2)
    _run(tmp_path, online, "online.yaml")
    cached = json.loads(json.dumps(online))
    cached["run"]["output_dir"] = str(tmp_path / "offline")
    cached["teacher"]["cache_dir"] = str(tmp_path / "cache")
    path = tmp_path / "offline.yaml"
    path.write_text(yaml.safe_dump(cached))
    assert main(["cache-teacher", str(path)]) == 0
    assert json.loads((tmp_path / "cache" / "manifest.json").read_text())["top_k"] == 8
    cached["teacher"]["source"] = "cache"
    _run(tmp_path, cached, "offline.yaml")
    got, want = train_by_step(tmp_path / "offline"), train_by_step(tmp_path / "online")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step, r in want.items():
        for key in ("loss", "kd_loss", "ce_loss"):
            assert got[step][key] == pytest.approx(r[key], rel=1e-5), (step, key)


def test_on_policy_steps_with_a_float8_teacher(teachers, corpus_dir, tmp_path):
    """Half the steps on the student's own samples, scored by the float8 teacher at
    tp x ep: they train, with finite losses."""
    fp8, _, _ = teachers
    tree = _tree(corpus_dir, tmp_path / "out", fp8, ep=2)
    tree["distill"]["on_policy"] = {"fraction": 0.5, "max_new_tokens": 8}
    _run(tmp_path, tree)
    train = read_train(tmp_path / "out")
    assert any(r["on_policy"] > 0 for r in train)
    assert all(np.isfinite(r["loss"]) and r["kd_loss"] > 0 for r in train)


@pytest.mark.slow
def test_a_deepseek_teacher_across_tokenizers_distils_below_cross_entropy(tmp_path, corpus_dir):
    """A DeepSeek-V3-shaped teacher (latent attention, group-limited sigmoid routing, a
    shared expert, a dense first layer) bootstrapped on the byte tokenizer's rows, then
    distilled into a Qwen3-shaped student of a BPE vocabulary (`teacher.tokenizer: bytes`,
    the cross-tokenizer first-byte loss): the student's held-out bits per byte end below
    the same student's trained on cross-entropy alone, the same steps from the same start."""
    from distill.data.bpe import train_bpe
    from tests.conftest import read_evals, write_config
    from tests.test_shipped_2026 import TINY_DEEPSEEK

    student = {
        "family": "qwen3", "qk_norm": True, "d_model": 32, "n_layers": 2, "n_heads": 4,
        "n_kv_heads": 2, "head_dim": 8, "d_ff": 64,
    }  # fmt: skip
    teacher_dir = tmp_path / "teacher"
    boot = tiny_config(str(corpus_dir), str(tmp_path / "boot"), mesh={"teacher": {"tp": 1}})
    boot["teacher"].update(
        model={**TINY_DEEPSEEK, "vocab_size": 260}, checkpoint=str(teacher_dir),
        pretrain_steps=300, top_k=None,
    )  # fmt: skip
    boot["student"] = {"model": student}
    # rows of the teacher's own bytes as long as the student's BPE rows spell (about 3
    # bytes a token): the teacher is trained at the positions it is asked for
    boot["train"].update(steps=1, eval_every=1, checkpoint_every=1, seq_len=128)
    assert main(["run", write_config(tmp_path, boot, "boot.yaml")]) == 0
    texts = [p.read_text() for p in sorted(corpus_dir.glob("*.txt"))]
    bpe = train_bpe(texts, 300, tmp_path / "bpe" / "tokenizer.json")
    bpb = {}
    for name, alpha in (("kd", 0.9), ("ce", 0.0)):
        cfg = tiny_config(str(corpus_dir), str(tmp_path / name), mesh={"teacher": {"tp": 1}})
        cfg["teacher"].update(
            model={**TINY_DEEPSEEK, "vocab_size": 260}, checkpoint=str(teacher_dir),
            pretrain_steps=0, top_k=None, tokenizer="bytes",
        )  # fmt: skip
        cfg["student"] = {"model": {**student, "vocab_size": 320}}
        cfg["data"]["tokenizer"] = str(bpe)
        cfg["distill"] = {"alpha": alpha, "temperature": 1.0, "alpha_gate": False}
        cfg["train"].update(steps=200, eval_every=200, checkpoint_every=200, log_every=50)
        assert main(["run", write_config(tmp_path, cfg, f"{name}.yaml")]) == 0
        bpb[name] = read_evals(tmp_path / name)[-1]
    # measured: 1.144 against 1.183 held-out bits per byte (the teacher's 1.015)
    assert bpb["kd"]["student_bpb"] < bpb["ce"]["student_bpb"], bpb
