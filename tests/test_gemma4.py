"""Gemma 4 text (`gemma4_text`) in the one model: a tiny transformers `Gemma4ForCausalLM`
(float32, six layers: two sliding then a full, twice; the full layers' heads twice as
wide, `global_head_dim`, and with `attention_k_eq_v` one KV head of their own and values
from the keys' projection; random O(1) weights, each layer's `layer_scalar` too) read by
distill's loader gives transformers' log-probabilities on a packed batch (each document
against transformers run on it alone) as the teacher at tp = 1, 2 and 4 (at 4 the KV heads
replicated over shards) and as the single-device student; with per-layer input embeddings
(`hidden_size_per_layer_input`) too."""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from distill.errors import DistillError  # noqa: E402
from distill.models import counts, decode, hf, model  # noqa: E402
from distill.types import Prompts  # noqa: E402
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
    # per-layer input embeddings (a table of 8 per layer and token), k_eq_v's full layers
    "per_layer_inputs": dict(
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=96,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    ),  # fmt: skip
    # the last three layers (sliding, sliding, full) take keys and values from layers 1 and
    # 2, their MLPs twice as wide; per-layer inputs too
    "kv_sharing_wide_mlp": dict(
        num_kv_shared_layers=3,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=96,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    ),  # fmt: skip
    # the MoE block: a dense MLP and 4 routed experts (top-2) side by side in every layer
    "moe_block": dict(
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    ),  # fmt: skip
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
    k_eq_v = name != "wide_full_untied"
    assert (cfg.n_experts, cfg.moe_beside_dense) == (
        (4, True) if name == "moe_block" else (0, False)
    )
    assert cfg.attn_k_eq_v == k_eq_v and cfg.kind_kv_heads("full") == (1 if k_eq_v else 2)
    assert cfg.norm_offset == 0 and cfg.scale() == 1.0 and cfg.v_norm and cfg.layer_scalar
    assert cfg.full_apart() and cfg.rope_proportional
    plain = ("k_eq_v_softcap", "wide_full_untied", "moe_block")
    assert cfg.per_layer_input == (0 if name in plain else 8)
    shared = name == "kv_sharing_wide_mlp"
    assert (cfg.kv_shared_layers, cfg.wide_mlp) == ((3, True) if shared else (0, False))
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
    layers = params["layers"]  # the full layers' own stacks, the sharing ones without keys
    assert layers["full_wq"].shape[0] == 2 and layers["full_wk"].shape[0] == 2 - (
        name == "kv_sharing_wide_mlp"
    )
    got = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(hidden_size_per_layer_input=8), "vocab_size_per_layer_input=262144 other"),
        (dict(num_kv_shared_layers=6), "num_kv_shared_layers=6 leaves no layer"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
        (dict(per_layer_config={"0": {"head_dim": 16}}), r"per_layer_config\[0\]"),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0}}),
            "rope_parameters.full_attention rope_type 'yarn'",
        ),
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
    if cfg.attn_k_eq_v:
        released["num_global_key_value_heads"] = 1
    other = _edit(path, tmp_path / "released", **released)
    assert hf.read_model_config(other) == cfg


def test_decode_with_a_cache_per_kind_matches_the_full_forward(gemma4):
    """Prefill then one token at a time: each step's logits are the full forward's at that
    position, the sliding and the full layers each in a cache of their own shapes."""
    _, path, _, _, batch = gemma4
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    tokens = batch.tokens[:1]
    seg, pos = jnp.ones_like(tokens), jnp.arange(tokens.shape[1])[None]
    full = np.asarray(model.apply(cfg, params, tokens, seg, pos))
    p, total = 7, tokens.shape[1]
    prompt = Prompts(tokens[:, :p], seg[:, :p], pos[:, :p])
    logits, cache = decode.prefill(cfg, params, prompt, total, dtype="float32")
    assert cache.k.shape[0] == 4 and cache.full[0].shape[0] == 2  # layers of each kind
    assert cache.full[0].shape[-2:] == (cfg.kind_kv_heads("full"), 16)
    np.testing.assert_allclose(logits, full[:, p - 1], atol=1e-4, rtol=1e-4)
    step = jax.jit(functools.partial(decode.decode_step, cfg, dtype="float32"))
    for i in range(p, total):
        logits, cache = step(params, tokens[:, i], pos[:, i], jnp.int32(i), jnp.ones(1, bool),
                             cache)  # fmt: skip
        np.testing.assert_allclose(logits, full[:, i], atol=1e-4, rtol=1e-4, err_msg=str(i))


def test_greedy_generation_equals_transformers(gemma4):
    """`decode.generate` at temperature 0 gives transformers' `generate(do_sample=False)`
    token for token on each row's last document (two documents in a row, left padding),
    past the sliding window."""
    from tests.test_qwen35 import _prompts

    _, path, ref, _, _ = gemma4
    cfg = hf.read_model_config(path)
    params = read_hf_layers(path, cfg, list(range(cfg.n_layers)))
    prompts, n = _prompts(80), 10
    run = jax.jit(lambda p, pr: decode.generate(cfg, p, pr, jax.random.key(0), max_new_tokens=n,
                                                temperature=0))  # fmt: skip
    tokens, valid, _ = run(params, prompts)
    assert bool(jnp.all(valid))
    for row in range(prompts.tokens.shape[0]):
        seg = np.asarray(prompts.segment_ids[row])
        ids = torch.from_numpy(np.asarray(prompts.tokens[row])[seg == seg[-1]][None]).long()
        with torch.no_grad():
            out = ref.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))  # fmt: skip
        np.testing.assert_array_equal(np.asarray(tokens[row]), out[0, ids.shape[1] :].numpy())


def pruned_gemma4(path, kept: list[int]):
    """The transformers Gemma 4 saved at `path` with only its layers `kept`: its config's
    per-layer keys (layer_types, per_layer_config, num_kv_shared_layers) of those layers,
    their weights, and their slices of the packed per-layer tables."""
    import json
    import re

    full = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    raw = json.loads((path / "config.json").read_text())
    n, shared = raw["num_hidden_layers"], raw.get("num_kv_shared_layers") or 0
    over = raw.get("per_layer_config") or {}
    raw.update(
        num_hidden_layers=len(kept), layer_types=[raw["layer_types"][i] for i in kept],
        num_kv_shared_layers=sum(i >= n - shared for i in kept),
        per_layer_config={str(j): over[str(i)] for j, i in enumerate(kept) if str(i) in over},
    )  # fmt: skip
    for key in ("model_type", "transformers_version", "architectures"):
        raw.pop(key, None)
    small = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**raw))
    p = raw.get("hidden_size_per_layer_input") or 0
    cols = np.concatenate([np.arange(i * p, (i + 1) * p) for i in kept]).astype(np.int64)
    weights = {}
    for key, value in full.state_dict().items():
        layer = re.match(r"model\.layers\.(\d+)\.(.*)", key)
        if key == "model.embed_tokens_per_layer.weight":
            weights[key] = value[:, cols]
        elif key == "model.per_layer_model_projection.weight":
            weights[key] = value[cols]
        elif layer is None:
            weights[key] = value
        elif int(layer[1]) in kept:
            weights[f"model.layers.{kept.index(int(layer[1]))}.{layer[2]}"] = value
    small.load_state_dict(weights)
    return small.eval()


def test_a_pruned_student_keeps_the_layer_pattern(gemma4, corpus_dir, tmp_path):
    """student.init: from_teacher with fewer layers: by default 3 of the 6 (0, 3, 5: two
    sliding, then the full last one, as the teacher's pattern runs); under KV sharing 5
    chosen (0, 1, 2, 3, 5: the kept sharing layers 3 and 5 take layers 1's and 2's keys and
    values, as in the teacher). The kept layers bring their kinds, per-layer inputs and
    sharing, and the student's log-probs are transformers' model pruned alike."""
    from distill.config.load import config_from_dict
    from tests.test_hf import _cfg_tree

    name, path, ref, want_full, batch = gemma4
    tree = _cfg_tree(corpus_dir, tmp_path / "out", path)
    tree["mesh"]["teacher"]["tp"] = 1
    sharing = name == "kv_sharing_wide_mlp"
    student = {"init": "from_teacher", "model": {"n_layers": 5 if sharing else 3}}
    tree["student"] = {**student, **({"init_layers": [0, 1, 2, 3, 5]} if sharing else {})}
    cfg = config_from_dict(tree)
    kept, s = cfg.init_layers(), cfg.student_model()
    assert kept == ([0, 1, 2, 3, 5] if sharing else [0, 3, 5])
    assert s.types() == tuple(cfg.teacher.model.types()[i] for i in kept)
    assert s.kv_shared_layers == (2 if sharing else 0)
    params = read_hf_layers(path, cfg.teacher.model, kept)
    got = model.apply(s, params, batch.tokens, batch.segment_ids, batch.positions)
    want = per_document_logprobs(pruned_gemma4(path, kept), batch)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)
    assert not np.allclose(want, want_full)  # pruning changed it


def test_a_student_starts_from_the_checkpoint(gemma4, corpus_dir, tmp_path):
    """student.checkpoint: the student's model and weights are the checkpoint's."""
    from distill.config.load import config_from_dict
    from teacher.weights import student_init_params
    from tests.test_hf import _cfg_tree

    name, path, _, want, batch = gemma4
    tree = _cfg_tree(corpus_dir, tmp_path, path)
    tree["student"] = {"checkpoint": str(path), "model": {"attention": "blockwise"}}
    cfg = config_from_dict(tree)
    s = cfg.student_model()
    assert s.model_copy(update={"attention": "auto"}) == hf.read_model_config(path)
    got = model.apply(s, student_init_params(cfg), batch.tokens, batch.segment_ids, batch.positions)
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)


def test_export_round_trips_through_transformers(gemma4, tmp_path):
    """`student.export.write_hf`: transformers loads the export as `Gemma4ForCausalLM` with
    the original's log-probs, and it reads back as the same config."""
    from tests.test_families import assert_export_round_trips

    got = assert_export_round_trips(*gemma4, tmp_path / "export")
    assert got.config.layer_types == gemma4[2].config.layer_types


@pytest.mark.parametrize("case", ["kv_sharing_wide_mlp", "moe_block"])
def test_student_steps_on_dp_x_fsdp_equal_one_device(tmp_path, case):
    """Two distillation steps of a fresh student of the checkpoint's config on dp = 2 x
    fsdp = 2 (the student's table splits its per-kind, per-layer-input and wide-MLP
    weights over fsdp; the MoE block's experts split over fsdp, its router reading the
    residual) equal the steps on one device: losses, and parameters after SGD
    (after one step to 1e-7; the second's summation orders move them by 1e-5, a ten
    thousandth of the step's update)."""
    import optax

    from distill.config import DistillLossConfig
    from distill.types import TeacherOutput
    from student import train
    from tests.test_generate import _mesh as student_mesh

    save_gemma4(tmp_path, CASES[case])  # every dense part; the MoE block (experts over fsdp)
    cfg, batch = hf.read_model_config(tmp_path), packed_batch()
    params = jax.device_get(model.init_params(cfg, 0))  # host arrays: the steps donate
    rows = jax.tree.map(lambda x: np.concatenate([x, x[::-1]]), batch)  # 4 rows
    rng = np.random.default_rng(0)
    vals, ids = jax.lax.top_k(jax.nn.log_softmax(rng.normal(size=(4, 24, 96)) * 3), 8)
    teacher = TeacherOutput(np.asarray(vals, np.float32), np.asarray(ids, np.int32))

    def run(dp, fsdp):
        mesh, tx = student_mesh(dp, fsdp), optax.sgd(0.1)
        step = train.make_train_step(cfg, tx, mesh, loss_cfg=DistillLossConfig(alpha=0.5),
                                     lr_schedule=lambda _: 0.1)  # fmt: skip
        state, losses = train.init_state(cfg, tx, 0, mesh, params), []
        for _ in range(2):
            state, metrics = step(state, rows, teacher)
            losses.append(float(metrics["loss"]))
        return jax.device_get(state.params), losses

    (one, l1), (four, l4) = run(1, 1), run(2, 2)
    np.testing.assert_allclose(l4, l1, rtol=2e-6)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(four), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-4)


def test_the_image_text_checkpoint_reads_as_its_text_model(tmp_path):
    """A `gemma4` checkpoint (`Gemma4ForConditionalGeneration`, as Gemma 4 is released;
    here without vision or audio towers): its `text_config` and the weights under
    `model.language_model.` read as `gemma4_text`, giving the model's log-probs on text."""
    torch.manual_seed(0)
    text = {**COMMON, **CASES["kv_sharing_wide_mlp"]}
    config = transformers.Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    m = transformers.Gemma4ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.3)
    m.save_pretrained(str(tmp_path))
    ref = type(m).from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager")
    cfg = hf.read_model_config(tmp_path)
    assert cfg.family == "gemma4_text" and cfg.kv_shared_layers == 3 and cfg.per_layer_input == 8
    batch = packed_batch()
    params = read_hf_layers(tmp_path, cfg, list(range(cfg.n_layers)))
    got = model.apply(cfg, params, batch.tokens, batch.segment_ids, batch.positions)
    text_model = type("Text", (), {"config": ref.config.text_config, "__call__": ref.eval()})()
    want = per_document_logprobs(text_model, batch)  # reads the vocabulary off the config
    assert_documents_match(_logprobs(got), want, batch, atol=2e-4, rtol=1e-4, err_msg="image-text")


def test_pipeline_stages_match_transformers_or_are_one_line(gemma4, corpus_dir, tmp_path):
    """mesh.teacher.pp = 2 (three layers a stage, each its own kinds): without per-layer
    inputs or KV sharing the staged teacher's log-probs are transformers'; with them
    refused before any device work, naming the key (a later stage would need the tokens
    and input embeddings, or an earlier stage's keys and values)."""
    from distill.config.load import config_from_dict
    from distill.mesh import teacher_mesh
    from teacher.stages import check_stages
    from tests.test_hf import _cfg_tree

    name, path, _, want, batch = gemma4
    tree = _cfg_tree(corpus_dir, tmp_path, path)
    tree["mesh"]["teacher"].update(pp=2, tp=1)
    cfg = config_from_dict(tree)
    if cfg.teacher.model.per_layer_input:  # the case sharing keys has per-layer inputs too
        with pytest.raises(DistillError, match=r"mesh.teacher.pp: 2 stages with per-layer input "
                           r"embeddings \(teacher.model.per_layer_input"):  # fmt: skip
            check_stages(cfg)
        return
    check_stages(cfg)
    mesh = teacher_mesh(jax.devices()[:4], 1, 2, 1, 2)
    params = load_hf_teacher(path, cfg.teacher.model, mesh)
    got = make_forward(cfg.teacher.model, mesh, mode="dense", microbatch=1)(params, batch)
    assert_documents_match(np.asarray(got[0]), want, batch, atol=2e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("ep, tp", [(2, 1), (2, 2)])
def test_the_moe_block_over_ep_matches_transformers(tmp_path, ep, tp):
    """The MoE block's teacher with its experts split over `ep` (dispatched to their
    devices and back) gives transformers' log-probs on the packed batch."""
    from distill.mesh import teacher_mesh

    ref = save_gemma4(tmp_path, CASES["moe_block"])
    batch = packed_batch()
    cfg = hf.read_model_config(tmp_path)
    mesh = teacher_mesh(jax.devices()[: ep * tp], 1, tp, ep)
    params = load_hf_teacher(tmp_path, cfg, mesh)
    got = make_forward(cfg, mesh, mode="logits")(params, batch)
    assert_documents_match(_logprobs(got), per_document_logprobs(ref, batch), batch, atol=2e-4,
                           rtol=1e-4, err_msg=f"ep={ep} tp={tp}")  # fmt: skip
