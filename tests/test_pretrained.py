"""A pretrained student of another family than its teacher: a Llama teacher (vocabulary 320)
and a Qwen3 student (vocabulary 288), both covering the 259 ids of the byte tokenizer, padded
differently. The student starts from its own weights, distils, resumes exactly from the
run's checkpoint, and exports as a Qwen3 model that transformers reads with distill's
log-probs."""

import json
import shutil

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distill.config.load import config_from_dict  # noqa: E402
from distill.data.tokenizers import ByteTokenizer  # noqa: E402
from distill.errors import DistillError  # noqa: E402
from distill.models import model  # noqa: E402
from pipelines.commands.cli import main  # noqa: E402
from teacher.weights import student_init_params  # noqa: E402
from tests.conftest import read_train  # noqa: E402
from tests.test_hf import _batch, _cfg_tree, _hf_logits, _save_llama  # noqa: E402

LIVE = ByteTokenizer.vocab_size


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(Llama teacher dir, Qwen3 student dir, the student as transformers loads it)."""
    teacher = tmp_path_factory.mktemp("llama_teacher")
    _save_llama(teacher, vocab_size=320, num_attention_heads=4, num_key_value_heads=2)
    student = tmp_path_factory.mktemp("qwen3_student")
    ref = _save_llama(
        student,
        arch="Qwen3",
        vocab_size=288,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return teacher, student, ref


def _tree(dirs, corpus_dir, out, **student):
    tree = _cfg_tree(corpus_dir, out, dirs[0])
    tree["student"] = {"checkpoint": str(dirs[1]), **student}
    tree["train"].update(steps=4, eval_every=2, checkpoint_every=2, log_every=2)
    # a random teacher, worse than the student: without the gate every step distils
    tree.setdefault("distill", {})["alpha_gate"] = False
    return tree


def test_student_model_and_weights_come_from_its_checkpoint(dirs, corpus_dir, tmp_path):
    cfg = config_from_dict(_tree(dirs, corpus_dir, tmp_path))
    scfg = cfg.student_model()
    assert (scfg.family, scfg.vocab_size, scfg.qk_norm) == ("qwen3", 288, True)
    assert cfg.vocab_sizes() == (320, 288)
    params = student_init_params(cfg)
    batch = _batch(LIVE)
    ours = model.apply(scfg, params, batch.tokens, batch.segment_ids, batch.positions)
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(dirs[2], batch.tokens), atol=1e-4)
    # runtime keys may be set; shape keys must agree with config.json
    config_from_dict(_tree(dirs, corpus_dir, tmp_path, model={"attention": "blockwise"}))
    with pytest.raises(DistillError, match=r"student.model.d_model: 32 differs from 16 in .*json"):
        config_from_dict(_tree(dirs, corpus_dir, tmp_path, model={"d_model": 32}))


def test_another_tokenizer_is_one_line(dirs, corpus_dir, tmp_path):
    other = tmp_path / "student"
    shutil.copytree(dirs[1], other)
    (other / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    tree = _tree(dirs, corpus_dir, tmp_path)
    tree["student"]["checkpoint"] = str(other)
    with pytest.raises(DistillError, match=r"not the run's tokenizer .*cross-tokenizer"):
        config_from_dict(tree)


def test_distil_resume_and_export_as_qwen3(dirs, corpus_dir, tmp_path, capsys):
    out = tmp_path / "out"
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_tree(dirs, corpus_dir, out)))
    assert main(["run", str(path)]) == 0
    whole = {r["step"]: r for r in read_train(out)}
    assert sorted(whole) == [2, 4] and all(np.isfinite(r["loss"]) for r in whole.values())

    # resume from the run's step-2 checkpoint: step 4 repeats exactly, not restarted from
    # student.checkpoint (whose weights are zeroed in the copy the resumed run names)
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    (resumed / "summary.json").unlink()
    zeroed = tmp_path / "zeroed"
    shutil.copytree(dirs[1], zeroed)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(zeroed))
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    m.save_pretrained(str(zeroed))
    tree = _tree((dirs[0], zeroed), corpus_dir, resumed)
    tree["data"] = yaml.safe_load((out / "config.yaml").read_text())["data"]
    path.write_text(yaml.safe_dump(tree))
    assert main(["run", str(path)]) == 0
    again = read_train(resumed)[len(whole) :]
    assert [r["step"] for r in again] == [4]
    for key in ("loss", "kd_loss", "ce_loss"):
        assert again[0][key] == pytest.approx(whole[4][key], rel=1e-4), key
    capsys.readouterr()

    assert main(["export", str(out)]) == 0
    exported = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["export"]
    got = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(got).__name__ == "Qwen3ForCausalLM"
    source = transformers.AutoConfig.from_pretrained(str(dirs[1])).max_position_embeddings
    assert got.config.max_position_embeddings == source > 64  # its context, not train.seq_len
    provenance = json.loads((out / "hf" / "distill.json").read_text())
    assert provenance["step"] == 4 and provenance["teacher"]

    from distill.checkpoint import Checkpointer
    from student import optim, train
    from tests.test_hf import _mesh

    cfg = config_from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    scfg = cfg.student_model()
    ckpt = Checkpointer(str(out / "checkpoints"))
    state, _, _ = ckpt.restore(
        train.saved(train.abstract_state(scfg, optim.make_optimizer(cfg.optim, 4), _mesh(1)))
    )
    ckpt.close()
    batch = _batch(LIVE, b=1, s=12)
    ours = model.apply(scfg, state.params, batch.tokens, batch.segment_ids, batch.positions)
    ours = np.asarray(ours)[..., :LIVE]  # the padded ids are trimmed on export
    want = torch.log_softmax(torch.tensor(ours), -1).numpy()
    theirs = torch.log_softmax(torch.tensor(_hf_logits(got, batch.tokens)), -1).numpy()
    np.testing.assert_allclose(theirs, want, atol=1e-4)


def test_the_export_keeps_the_context_of_the_model_it_started_from(dirs, corpus_dir, tmp_path):
    """max_position_embeddings: a pretrained student's own, a student cut from a Hugging
    Face teacher the teacher's, a random student the rows it was distilled on."""
    from student.export import context_length

    tree = _tree(dirs, corpus_dir, tmp_path / "out")
    seq = tree["train"]["seq_len"]
    source = transformers.AutoConfig.from_pretrained(str(dirs[1])).max_position_embeddings
    assert context_length(config_from_dict(tree)) == source
    tree["student"] = {"init": "random"}
    assert context_length(config_from_dict(tree)) == seq
    teacher = transformers.AutoConfig.from_pretrained(str(dirs[0])).max_position_embeddings
    tree["student"] = {"init": "from_teacher"}
    assert context_length(config_from_dict(tree)) == max(teacher, seq)


def test_the_export_keeps_the_special_ids_of_the_model_it_started_from(dirs, corpus_dir, tmp_path):
    """bos/eos/pad in the exported config.json: those the pretrained student's config.json
    names (Qwen3's names a BOS its tokenizer lacks; Llama 3 instruct several EOS ids), the
    tokenizer's for the ids it leaves unnamed, and none of them where its vocabulary is not
    the student's."""
    from student.export import special_ids

    named = tmp_path / "named"
    shutil.copytree(dirs[1], named)
    config = json.loads((named / "config.json").read_text())
    config.update(bos_token_id=5, eos_token_id=[2, 9], pad_token_id=None)
    (named / "config.json").write_text(json.dumps(config))
    tree = _tree((dirs[0], named), corpus_dir, tmp_path / "out")
    assert special_ids(config_from_dict(tree)) == {"bos_id": 5, "eos_id": [2, 9]}
    tree["student"] = {"init": "from_teacher"}  # the Llama teacher's vocabulary: 320
    teacher = transformers.AutoConfig.from_pretrained(str(dirs[0]))
    cut = {**tree["student"], "model": {"vocab_size": 320}}
    assert special_ids(config_from_dict({**tree, "student": cut})) == {
        "bos_id": teacher.bos_token_id,
        "eos_id": teacher.eos_token_id,
    }
    tree["student"] = {"init": "random"}
    assert special_ids(config_from_dict(tree)) == {}


@pytest.mark.parametrize("role", ["teacher", "student"])
def test_score_matches_transformers(dirs, corpus_dir, tmp_path, capsys, role):
    """`distill score --json`: the teacher on its tp=2 mesh, the student from its pretrained
    weights (the run has no checkpoint); transformers' log-probs over the tokenizer's ids."""
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_tree(dirs, corpus_dir, tmp_path / "out")))
    text = tmp_path / "held_out.txt"
    text.write_text("Distillation keeps what the teacher knows. ñ€ bytes too.\n")
    assert main(["score", str(path), "--file", str(text), "--model", role, "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = got["tokens"]
    assert ids[0] == ByteTokenizer.bos_id and ids[-1] == ByteTokenizer.eos_id
    assert len(got["logprobs"]) == len(ids) - 1
    ref = (
        dirs[2]
        if role == "student"
        else transformers.AutoModelForCausalLM.from_pretrained(str(dirs[0]), dtype=torch.float32)
    )
    z = torch.tensor(_hf_logits(ref, np.array([ids])))[0, :, :LIVE]
    want = torch.log_softmax(z, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(got["logprobs"], want, atol=1e-4)
    assert got["nll"] == pytest.approx(-want.mean(), abs=1e-4)
    assert got["perplexity"] == pytest.approx(np.exp(-want.mean()), rel=1e-4)
    assert main(["score", str(path), "--file", str(tmp_path / "missing.txt")]) == 2
