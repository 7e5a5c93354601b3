"""The quick start's programs with Qwen3.5-shaped models (`tests/test_lowering.py`'s
method: built by the product's builders for the platform, lowered to StableHLO for CUDA
and TPU on this CPU): a hybrid teacher and student, three linear-attention layers to a
full one, every program of a run lowers, the chunked rule's triangular solve in each that
runs the model over rows, the platform's attention kernel in each that attends, and none
holds a host callback, float64 or a collective across devices. Lowering is not compiling
nor running: those need the device."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from distill.config.load import load_config
from pipelines.placement.costs import resolve
from tests.test_lowering import KERNEL, cross_device, lowered

HYBRID = {
    "layer_types": "[linear,linear,linear,full]", "attn_output_gate": "true",
    "qk_norm": "true", "norm_offset": "1.0", "partial_rotary_factor": "0.25",
    "linear_k_heads": "4", "linear_v_heads": "8", "linear_k_dim": "32", "linear_v_dim": "32",
}  # fmt: skip


def hybrid_on_one(platform: str):
    """The quick start with a hybrid teacher (its 4 layers) and student (2 layers: linear,
    full), resolved as on one `platform` device (`tests.test_lowering.quickstart_on_one`)."""
    sets = [f"teacher.model.{k}={v}" for k, v in HYBRID.items()]
    sets.append("student.model.layer_types=[linear,full]")
    cfg = load_config("pipelines/quickstart.yaml", sets)
    resolve(cfg, [SimpleNamespace(platform=platform)])
    assert cfg.mesh.placement == "colocated" and cfg.teacher.dtype == "bfloat16"
    assert cfg.student_model().types() == ("linear", "full")
    cfg.train.remat, cfg.train.layer_loop = "none", "scan"
    return cfg


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_the_hybrid_quick_start_on_one_device_lowers(platform):
    texts = lowered(hybrid_on_one(platform), platform)
    assert len(texts) == 11
    for name, text in texts.items():
        model = not re.search(r"init|NLL|check", name)
        assert bool(re.search(KERNEL[platform], text)) == model, name
        assert ("triangular_solve" in text) == model, name  # the sampler: its prefill
        assert "callback" not in text, name
        assert not re.search(r"\bf64\b|xf64>", text), name
        assert cross_device(text) == [], name
