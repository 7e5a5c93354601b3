"""Hugging Face families in the one model: for each family a tiny model built by
transformers (random weights, saved to a temporary directory) is read by distill's loader
and gives transformers' log-probabilities, on the teacher's tensor-parallel mesh at tp=1,
tp=2 and tp=4 (more shards than KV heads: the KV heads are replicated), and as the
single-device student model. The batch is packed: rows of several documents (segment ids
and positions restarting at each) and trailing padding, each document compared with
transformers run on that document alone. Rows and documents are longer than the sliding
windows, models have both local and global layers, and the vocabulary is padded past the
ids used."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from distill.config import ModelConfig  # noqa: E402
from distill.errors import DistillError  # noqa: E402
from distill.models import decode, hf, model, parts, vocab_loss  # noqa: E402
from distill.models import losses as ref_losses  # noqa: E402
from distill.types import Batch  # noqa: E402
from teacher.forward import make_forward  # noqa: E402
from teacher.hf import load_hf_teacher, read_hf_layers  # noqa: E402
from tests.test_hf import _batch, _hf_logits, _mesh  # noqa: E402

WINDOW = 5  # documents of 6 to 13 tokens: many keys fall outside a sliding layer's window
DOCS = [[13, 11], [7, 6, 7]]  # document lengths per packed row of 24; the second row ends in
# 4 padding tokens
COMMON = dict(
    vocab_size=96,  # ids drawn below LIVE: padded past them
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LIVE = 80

FAMILIES = {  # name: (transformers class prefix, config class, config keys)
    "mistral_sliding": ("Mistral", "MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2_tied_biases_sliding_top_layers": (
        "Qwen2",
        "Qwen2Config",
        dict(
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=2,
            tie_word_embeddings=True,
            rope_theta=1e6,
        ),
    ),
    "qwen3_head_dim_qk_norm_untied": (
        "Qwen3",
        "Qwen3Config",
        dict(head_dim=16, tie_word_embeddings=False, rope_theta=1e6)
        | dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "gemma2_softcaps_alternating": (
        "Gemma2",
        "Gemma2Config",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,  # small caps that the random scores and logits reach
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3_one_kv_head_local_rope": (
        "Gemma3",
        "Gemma3TextConfig",
        dict(
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
}


def _save(path, name, families=FAMILIES, common=COMMON):
    """A tiny transformers model of `families[name]` (prefix, config class, keys) saved at
    `path`, random O(1) weights; the model read back in float32 with eager attention."""
    prefix, config_class, keys = families[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**common, **keys})
    m = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():  # O(1) weights, non-trivial norms and biases: every mapping shows
        for pname, p in m.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in pname else p.normal_(0.0, 0.3)
    m.save_pretrained(str(path))
    ref = type(m).from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return ref.eval()


def packed_batch(docs=DOCS, s=24, live=LIVE, seed=1) -> Batch:
    """Rows of documents of the given lengths, packed as `distill.data.packing` packs them:
    segment ids 1, 2, ... and positions restarting at each document, padding (segment 0)
    after the last; targets the next token of the same document, masked elsewhere."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, live, (len(docs), s)).astype(np.int32)
    seg, pos = np.zeros_like(tokens), np.zeros_like(tokens)
    for row, lengths in enumerate(docs):
        start = 0
        for i, n in enumerate(lengths):
            seg[row, start : start + n], pos[row, start : start + n] = i + 1, np.arange(n)
            start += n
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    targets = np.concatenate([np.where(same, tokens[:, 1:], 0), np.zeros_like(tokens[:, :1])], 1)
    mask = np.concatenate([same, np.zeros_like(same[:, :1])], 1).astype(np.float32)
    return Batch(tokens, targets, seg, pos, mask)


def per_document_logprobs(hf_model, batch: Batch) -> np.ndarray:
    """[B, S, V] log-probs of transformers run on each packed document alone, placed where
    the document sits in its row (zeros on padding)."""
    v = hf_model.config.vocab_size
    out = np.zeros((*batch.tokens.shape, v), np.float32)
    for row, seg in enumerate(batch.segment_ids):
        for doc in set(seg.tolist()) - {0}:
            where = np.flatnonzero(seg == doc)
            logits = _hf_logits(hf_model, batch.tokens[row : row + 1, where])[0]
            out[row, where] = torch.log_softmax(torch.tensor(logits), -1).numpy()
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, directory, transformers model, its per-document log-probs on the packed
    batch, the batch)."""
    path = tmp_path_factory.mktemp(request.param)
    ref = _save(path, request.param)
    batch = packed_batch()
    return request.param, path, ref, per_document_logprobs(ref, batch), batch


def _logprobs(logits):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


def assert_documents_match(got, want, batch, atol, rtol, err_msg):
    """got and want [B, S, V] equal on every document's tokens (padding left out)."""
    real = np.asarray(batch.segment_ids) > 0
    assert real.sum() < real.size  # the batch has padding, which is left out
    np.testing.assert_allclose(got[real], want[real], atol=atol, rtol=rtol, err_msg=err_msg)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_teacher_logprobs_match_transformers(family, tp):
    name, path, _, want, batch = family
    cfg = hf.read_model_config(path)
    params = load_hf_teacher(path, cfg, _mesh(tp))
    got = make_forward(cfg, _mesh(tp), mode="logits")(params, batch)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)


def test_config_reads_each_family(family):
    name, path, ref, _, _ = family
    cfg = hf.read_model_config(path)
    assert cfg.family == ref.config.model_type
    uniform = "sliding_attention" if ref.config.sliding_window else "full_attention"
    hf_types = getattr(ref.config, "layer_types", None) or [uniform] * cfg.n_layers  # Mistral
    assert list(cfg.types()) == [hf.LAYER_TYPES[t] for t in hf_types]
    assert "sliding" in cfg.types(), name  # every case here has sliding layers...
    if name != "mistral_sliding":
        assert cfg.mixed_layers()  # ...and, but for Mistral, full ones too
    assert cfg.tie_embeddings == ref.config.tie_word_embeddings


def test_student_model_and_chunked_loss_match_transformers(family):
    """The single-device model (the student's) on the same weights, and its chunked CE
    (soft-capped logits a chunk at a time) against CE of transformers' log-probs."""
    name, path, _, want, batch = family
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    args = (batch.tokens, batch.segment_ids, batch.positions)
    blockwise = cfg.model_copy(update={"attention": "blockwise"})
    got = model.apply(blockwise, params, *args)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)

    x, head = model.apply_hidden(cfg, params, *args)
    ce, _ = vocab_loss.ce_loss_chunked(
        x, head, batch.targets, batch.mask, chunk=7, softcap=cfg.final_softcap
    )
    want_ce, _ = ref_losses.ce_loss(jnp.asarray(want), batch.targets, batch.mask)
    np.testing.assert_allclose(float(ce), float(want_ce), rtol=1e-5)


def test_decode_with_a_cache_matches_the_full_forward(family):
    """Prefill then one token at a time: each step's logits are the full forward's at that
    position (sliding windows over the cache, soft-caps, per-layer RoPE)."""
    _, path, _, _, _ = family
    batch = _batch(LIVE)  # one document a row: a decode continues one document
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    tokens, seg, pos = batch.tokens[:1], batch.segment_ids[:1], batch.positions[:1]
    full = np.asarray(model.apply(cfg, params, tokens, seg, pos))
    p, total = 8, tokens.shape[1]
    prompt = batch._replace(tokens=tokens[:, :p], segment_ids=seg[:, :p], positions=pos[:, :p])
    logits, cache = decode.prefill(cfg, params, prompt, total, dtype="float32")
    np.testing.assert_allclose(logits, full[:, p - 1], atol=1e-4, rtol=1e-4)
    writes = jnp.ones((1,), bool)
    for i in range(p, total):
        logits, cache = decode.decode_step(
            cfg, params, tokens[:, i], pos[:, i], jnp.int32(i), writes, cache, dtype="float32"
        )
        np.testing.assert_allclose(logits, full[:, i], atol=1e-4, rtol=1e-4, err_msg=str(i))


def _edit(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **changes}))
    return dst


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    _save(path, "gemma3_one_kv_head_local_rope")
    return path


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
        (dict(hidden_activation="relu"), "hidden_activation='relu'"),
        (dict(layer_types=["chunked_attention"] * 4), "layer_types entry 'chunked_attention'"),
        (dict(attention_bias=True), "attention_bias=True"),
    ],
)
def test_unrunnable_keys_name_the_file_and_key(gemma3_dir, tmp_path, changes, match):
    bad = _edit(gemma3_dir, tmp_path / "bad", **changes)
    with pytest.raises(DistillError, match=rf"{bad / 'config.json'}: .*{match}"):
        hf.read_model_config(bad)


def test_llama_with_a_window_is_refused(tmp_path):
    from tests.test_hf import _save_llama

    _save_llama(tmp_path / "llama")
    bad = _edit(tmp_path / "llama", tmp_path / "bad", sliding_window=8)
    with pytest.raises(DistillError, match=r"config.json: sliding_window=8 is not supported"):
        hf.read_model_config(bad)


def test_default_config_is_llama():
    cfg = ModelConfig()
    assert cfg.family == "llama" and not cfg.mixed_layers() and parts.layer_data(cfg) is None
    assert set(model.abstract_params(cfg)["layers"]) == set(hf.LAYER_WEIGHTS)


def pruned_reference(path, kept: list[int]):
    """The transformers model saved at ``path`` with only its layers ``kept``, each with
    its own attention type (window, RoPE): a model of len(kept) layers and those weights."""
    import copy
    import re

    full = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    config = copy.deepcopy(full.config)
    config.num_hidden_layers = len(kept)
    for key in ("layer_types", "no_rope_layers"):  # the per-layer lists of the config
        if getattr(config, key, None) is not None:
            setattr(config, key, [getattr(config, key)[i] for i in kept])
    small = type(full)(config)
    weights = {}
    for key, value in full.state_dict().items():
        layer = re.match(r"model\.layers\.(\d+)\.(.*)", key)
        if layer is None:
            weights[key] = value
        elif int(layer[1]) in kept:
            weights[f"model.layers.{kept.index(int(layer[1]))}.{layer[2]}"] = value
    small.load_state_dict(weights)
    return small.eval()


@pytest.mark.parametrize(
    "name", ["gemma3_one_kv_head_local_rope", "gemma2_softcaps_alternating", "mistral_sliding"]
)
def test_depth_pruned_student_matches_transformers_pruned_alike(name, corpus_dir, tmp_path_factory):
    """student.init: from_teacher with student.model.n_layers 3 of a 4-layer teacher whose
    layers differ in window and RoPE: the kept layers (0, 2, 3) bring their types, and the
    student's log-probs are those of the transformers model with the same layers kept."""
    from distill.config.load import config_from_dict
    from tests.test_hf import _cfg_tree

    path = tmp_path_factory.mktemp(name)
    ref = _save(path, name)
    tree = _cfg_tree(corpus_dir, tmp_path_factory.mktemp("out"), path)
    tree["mesh"]["teacher"]["tp"] = 1
    tree["student"] = {"init": "from_teacher", "model": {"n_layers": 3, "attention": "blockwise"}}
    cfg = config_from_dict(tree)
    kept, t, s = cfg.init_layers(), cfg.teacher.model, cfg.student_model()
    assert kept == [0, 2, 3] and s.types() == tuple(t.types()[i] for i in kept)
    if name != "mistral_sliding":  # each keeps a full and a sliding layer
        assert s.mixed_layers() and "full" in s.types()
    batch = packed_batch()
    params = read_hf_layers(path, t, kept)
    got = model.apply(s, params, batch.tokens, batch.segment_ids, batch.positions)
    want = per_document_logprobs(pruned_reference(path, kept), batch)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)
    assert not np.allclose(want, per_document_logprobs(ref, batch))  # pruning changed it
    # a student that sets its own layer_types is checked against the kept layers
    tree["student"]["model"]["layer_types"] = ["full"] * 3
    with pytest.raises(DistillError, match=r"student.model.layer_types: \['full'"):
        config_from_dict(tree)


def test_export_in_the_students_own_family(family, tmp_path):
    """`student.export.write_hf` of a model read from each family's checkpoint: transformers
    loads it as that family's class and gives the original's log-probs."""
    assert_export_round_trips(*family, tmp_path / "export")


def assert_export_round_trips(name, path, ref, want, batch, out, **write):
    """The model read from `path` exported to `out` (`write_hf` keywords `write`) loads in
    transformers as `ref`'s class with its log-probs `want`, and reads back as itself;
    returns the loaded model."""
    from student.export import write_hf

    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    out = write_hf(out, cfg, params, max_position_embeddings=64, **write)
    got = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(got) is type(ref), name
    logp = per_document_logprobs(got, batch)
    assert_documents_match(logp, want, batch, atol=2e-5, rtol=1e-5, err_msg=name)
    assert hf.read_model_config(out) == cfg
    return got


def test_a_config_its_family_cannot_write_is_one_line():
    from distill.models.hf.export import to_hf_config

    with pytest.raises(
        DistillError, match=r"student.model.qk_norm=True cannot be written as a llama"
    ):
        to_hf_config(ModelConfig(qk_norm=True), max_position_embeddings=64)
    mixed = ModelConfig(
        family="mistral", sliding_window=4, layer_types=("full",) * 3 + ("sliding",)
    )
    with pytest.raises(DistillError, match=r"layer_types=.*cannot be written as a mistral"):
        to_hf_config(mixed, max_position_embeddings=64)
