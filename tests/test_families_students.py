"""The small open models students are made of, against transformers: SmolLM3 (layers
without RoPE; Gemma 4 text is tests/test_gemma4.py's). For each, a tiny random model
saved by transformers is read by distill's loader and gives transformers'
log-probabilities on a packed batch (each document against transformers run on it alone)
as the teacher at tp=1 and tp=2 and as the single-device student under every attention
kernel; its cached decode equals the full forward and its greedy generation equals
transformers' token for token; it exports in its own family with equal log-probabilities;
a student starts from it and is pruned from it."""

import copy
import json

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from distill.config.load import config_from_dict  # noqa: E402
from distill.errors import DistillError  # noqa: E402
from distill.models import decode, hf, model  # noqa: E402
from distill.types import Prompts  # noqa: E402
from teacher.hf import read_hf_layers  # noqa: E402
from teacher.weights import student_init_params  # noqa: E402
from tests.test_families import (  # noqa: E402
    COMMON,
    LIVE,
    WINDOW,
    _logprobs,
    _save,
    assert_documents_match,
    assert_export_round_trips,
    packed_batch,
    per_document_logprobs,
    pruned_reference,
)
from tests.test_families import (  # noqa: E402
    test_teacher_logprobs_match_transformers as teacher_logprobs_match_transformers,
)
from tests.test_hf import _cfg_tree  # noqa: E402

SMOL_IDS = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)  # in the tiny vocabulary
CASES = {  # name: (transformers class prefix, config class, config keys)
    # every other layer NoPE, no window: RoPE is the only per-layer difference
    "smollm3_nope": ("SmolLM3", "SmolLM3Config", dict(no_rope_layer_interval=2, **SMOL_IDS)),
    # NoPE layers and windows set apart: NoPE full, NoPE sliding, RoPE sliding, RoPE full
    "smollm3_nope_sliding": (
        "SmolLM3",
        "SmolLM3Config",
        dict(
            no_rope_layers=[0, 0, 1, 1],
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
            tie_word_embeddings=False,
            **SMOL_IDS,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, directory, transformers model, its per-document log-probs, the batch)."""
    path = tmp_path_factory.mktemp(request.param)
    ref = _save(path, request.param, CASES)
    batch = packed_batch()
    return request.param, path, ref, per_document_logprobs(ref, batch), batch


def test_config_reads_which_layers_rotate(case):
    name, path, ref, _, _ = case
    cfg = hf.read_model_config(path)
    assert cfg.family == ref.config.model_type
    assert list(cfg.ropes()) == [bool(r) for r in ref.config.no_rope_layers]
    assert not all(cfg.ropes()) and cfg.mixed_layers()
    assert cfg.types() == tuple(hf.LAYER_TYPES[t] for t in ref.config.layer_types)


@pytest.mark.parametrize("tp", [1, 2])
def test_teacher_logprobs_match_transformers(case, tp):
    teacher_logprobs_match_transformers(case, tp)


@pytest.mark.parametrize("attention", ["reference", "blockwise", "prefix"])
def test_student_model_matches_transformers(case, attention):
    name, path, _, want, batch = case
    cfg = hf.read_model_config(path).model_copy(update={"attention": attention})
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    got = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)


def _prompts(n: int = 2, p: int = 7, seed: int = 3) -> Prompts:
    tokens = np.random.default_rng(seed).integers(0, LIVE, (n, p)).astype(np.int32)
    pos = np.tile(np.arange(p, dtype=np.int32), (n, 1))
    return Prompts(jnp.asarray(tokens), jnp.ones_like(tokens), jnp.asarray(pos))


def test_greedy_generation_equals_transformers(case):
    """`decode.generate` at temperature 0 (prefill, then the KV cache a token at a time:
    windows over the cache, NoPE layers) against transformers' greedy `generate`."""
    _, path, ref, _, _ = case
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    prompts, n = _prompts(), 9
    tokens, valid, _ = decode.generate(
        cfg, params, prompts, jax.random.key(0), max_new_tokens=n, temperature=0
    )
    with torch.no_grad():
        out = ref.generate(
            torch.tensor(np.asarray(prompts.tokens), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(tokens), out[:, prompts.tokens.shape[1] :].numpy())
    assert bool(jnp.all(valid))


def test_export_round_trips_through_transformers(case, tmp_path):
    got = assert_export_round_trips(*case, tmp_path / "export")
    assert got.config.no_rope_layers == case[2].config.no_rope_layers


def test_a_bfloat16_export_in_shards_loads_in_transformers(case, tmp_path):
    """bfloat16 weights in shards of at most 20 kB (a tensor larger than that alone): the
    index json names every tensor's file, transformers loads it as its own model rounded
    to bfloat16 (same log-probs), and distill reads it back as the bfloat16 weights."""
    from student.export import write_hf

    name, path, ref, _, batch = case
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    limit = 20_000
    out = write_hf(
        tmp_path / "export", cfg, params, max_position_embeddings=64, dtype="bfloat16",
        max_shard_bytes=limit,
    )  # fmt: skip
    index = json.loads((out / hf.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert json.loads((out / hf.CONFIG).read_text())["torch_dtype"] == "bfloat16"
    for file in files:
        with safe_open(out / file, framework="numpy") as f:
            names = f.keys()
            sizes = [np.prod(f.get_slice(k).get_shape()) * 2 for k in names]
            assert {f.get_slice(k).get_dtype() for k in names} == {"BF16"}
        assert sum(sizes) <= limit or len(sizes) == 1, file
    assert index["metadata"]["total_size"] == sum(
        p.numel() * 2
        for p in ref.parameters()  # each once: a tied head is the embedding
    )
    got = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    rounded = copy.deepcopy(ref)  # its weights rounded, not its RoPE buffers
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    want = per_document_logprobs(rounded, batch)
    assert_documents_match(per_document_logprobs(got, batch), want, batch, 2e-5, 1e-5, name)
    back = read_hf_layers(out, cfg, list(range(cfg.n_layers)))
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(x).astype(ml_dtypes.bfloat16), np.asarray(y))


def test_a_student_starts_from_the_checkpoint(case, corpus_dir, tmp_path):
    """student.checkpoint: the student's model and weights are the checkpoint's."""
    name, path, _, want, batch = case
    tree = _cfg_tree(corpus_dir, tmp_path, path)
    tree["student"] = {"checkpoint": str(path), "model": {"attention": "blockwise"}}
    cfg = config_from_dict(tree)
    s = cfg.student_model()
    assert s.ropes() == hf.read_model_config(path).ropes()
    got = model.apply(s, student_init_params(cfg), batch.tokens, batch.segment_ids, batch.positions)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)


def test_a_pruned_student_keeps_its_layers_rope(case, corpus_dir, tmp_path):
    """student.init: from_teacher with 3 of 4 layers (0, 2, 3): each kept layer brings
    whether it rotates, and the student's log-probs are transformers' pruned alike."""
    name, path, ref, _, batch = case
    tree = _cfg_tree(corpus_dir, tmp_path, path)
    tree["mesh"]["teacher"]["tp"] = 1
    tree["student"] = {"init": "from_teacher", "model": {"n_layers": 3, "attention": "blockwise"}}
    cfg = config_from_dict(tree)
    kept, t, s = cfg.init_layers(), cfg.teacher.model, cfg.student_model()
    assert kept == [0, 2, 3] and s.ropes() == tuple(t.ropes()[i] for i in kept)
    params = read_hf_layers(path, t, kept)
    got = model.apply(s, params, batch.tokens, batch.segment_ids, batch.positions)
    want = per_document_logprobs(pruned_reference(path, kept), batch)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)
    tree["student"]["model"]["rope_layers"] = [True] * 3  # its own, not the kept layers'
    with pytest.raises(DistillError, match=r"student.model.rope_layers: \[True, True, True\]"):
        config_from_dict(tree)


def test_sliding_layers_without_use_sliding_window_are_one_line(tmp_path):
    from tests.test_families import _edit

    src = tmp_path / "src"
    _save(src, "smollm3_nope_sliding", CASES)
    bad = _edit(src, tmp_path / "bad", use_sliding_window=False)
    with pytest.raises(DistillError, match=r"config.json: layer_types has sliding layers"):
        hf.read_model_config(bad)


assert COMMON["num_hidden_layers"] == 4  # the cases' per-layer lists are of 4 layers
