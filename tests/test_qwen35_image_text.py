"""Qwen3.5 as released: `qwen3_5` / `qwen3_5_moe` image-text checkpoints (config.json nests the
text model as `text_config`; the weights hold it under `model.language_model.`, beside the
vision tower `model.visual.*` and the multi-token-prediction layer `mtp.*`). A tiny
transformers Qwen3_5ForConditionalGeneration (and its mixture) saved here, an `mtp.` tensor
added as the released files have one: distill reads its text model as `qwen3_5_text`
(`qwen3_5_moe_text`) and gives the image-text model's own log-probs on text, as the teacher
at tp = 2 and as the student; the student exports as the text family transformers loads
with equal log-probs."""

import logging

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from distill.errors import DistillError  # noqa: E402
from distill.mesh import teacher_mesh  # noqa: E402
from distill.models import hf, model  # noqa: E402
from distill.models.hf import files as hf_files  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.hf import load_hf_teacher, read_hf_layers  # noqa: E402
from tests.test_families import _logprobs, assert_documents_match, packed_batch  # noqa: E402
from tests.test_qwen35 import COMMON, MOE  # noqa: E402

VISION = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
    patch_size=4, spatial_merge_size=1, temporal_patch_size=1,
)  # fmt: skip
KINDS = {
    "qwen3_5": ("Qwen3_5", "qwen3_5_text", COMMON),
    "qwen3_5_moe": (
        "Qwen3_5Moe", "qwen3_5_moe_text",
        {**{k: v for k, v in COMMON.items() if k != "intermediate_size"}, **MOE},
    ),
}  # fmt: skip


def _save_image_text(path, kind: str, tied: bool):
    """The image-text model saved at `path` with O(1) random weights and an extra `mtp.`
    tensor in its file; the model itself, for reference log-probs."""
    prefix, _, text = KINDS[kind]
    config = getattr(transformers, f"{prefix}Config")(
        text_config={**text, "tie_word_embeddings": tied}, vision_config=VISION,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    m = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.3)
    m.save_pretrained(str(path))
    file = path / hf.SINGLE_FILE
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, file, metadata={"format": "pt"})
    return m.eval()


def _reference(m, batch) -> np.ndarray:
    """[B, S, V] log-probs of the image-text model run on each document alone (text only)."""
    v = m.config.text_config.vocab_size
    out = np.zeros((*batch.tokens.shape, v), np.float32)
    for row, seg in enumerate(batch.segment_ids):
        for doc in set(seg.tolist()) - {0}:
            where = np.flatnonzero(seg == doc)
            ids = torch.tensor(batch.tokens[row : row + 1, where], dtype=torch.long)
            with torch.no_grad():
                logits = m(input_ids=ids).logits[0].float()
            out[row, where] = torch.log_softmax(logits, -1).numpy()
    return out


@pytest.fixture(scope="module", params=[("qwen3_5", False), ("qwen3_5_moe", True)],
                ids=["dense-untied", "moe-tied"])  # fmt: skip
def released(request, tmp_path_factory):
    kind, tied = request.param
    path = tmp_path_factory.mktemp(kind)
    m = _save_image_text(path, kind, tied)
    batch = packed_batch()
    return kind, path, _reference(m, batch), batch


def test_the_text_model_is_read(released, caplog):
    kind, path, _, _ = released
    cfg = hf.read_model_config(path)
    assert cfg.family == KINDS[kind][1] and cfg.types() == ("linear", "linear", "linear", "full")
    assert cfg.tie_embeddings == (kind == "qwen3_5_moe")
    names = hf_files.weight_files(path)
    assert "model.embed_tokens.weight" in names and not any("visual" in n for n in names)
    assert "mtp.fc.weight" not in names
    with caplog.at_level(logging.INFO, logger="distill"):
        hf_files.check_checkpoint(path, cfg, 2)
    assert "image-text checkpoint" in caplog.text and "model.visual.*" in caplog.text
    assert "mtp.fc.*" in caplog.text


def test_teacher_and_student_give_the_image_text_model_s_logprobs(released):
    _, path, want, batch = released
    cfg = hf.read_model_config(path)
    mesh = teacher_mesh(jax.devices()[:2], 1, 2)
    got = make_forward(cfg, mesh, mode="logits")(load_hf_teacher(path, cfg, mesh), batch)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg="tp=2")
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    got = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg="student")


def test_the_student_exports_as_the_text_family(released, tmp_path):
    from student.export import write_hf

    kind, path, want, batch = released
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    out = write_hf(tmp_path / "export", cfg, params, max_position_embeddings=64)
    got = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(got).__name__ == f"{KINDS[kind][0]}ForCausalLM"
    assert hf.read_model_config(out) == cfg
    with torch.no_grad():
        for row, seg in enumerate(batch.segment_ids):
            for doc in set(seg.tolist()) - {0}:
                where = np.flatnonzero(seg == doc)
                ids = torch.tensor(batch.tokens[row : row + 1, where], dtype=torch.long)
                logp = torch.log_softmax(got(input_ids=ids).logits[0].float(), -1).numpy()
                np.testing.assert_allclose(logp, want[row, where], atol=2e-5, rtol=1e-5)


def test_an_image_text_config_without_its_text_config_is_one_line(tmp_path):
    with pytest.raises(DistillError, match="model_type 'qwen3_5' without a text_config"):
        hf.model_config_from_raw({"model_type": "qwen3_5"}, tmp_path / "config.json")
