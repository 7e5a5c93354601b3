"""No array ending in the vocabulary, and no sort or top-k operand, of 2^31 elements or more
(`distill.limits.MAX_ELEMENTS`: GPU sorts and kernels index with 32 bits, issue 32).

The 8B-to-1B programs are compiled, never run, from abstract shapes on the simulated CPU
devices, at 8 and 16 rows a device (the shipped layout: teacher dp=4, student fsdp=4): the
teacher's top-k output and the student step from it, the dense output (in one block per
microbatch) and the student step from its blocks, evaluation (the teacher's logits
and the student's metrics), the on-policy teacher's target log-probs and `distill score` of
a 32,768-token document (a row past 16,744 tokens of 128,256 ids is over the bound). The
real widths, vocabulary and S = 4,096, but one layer of each model: the vocabulary arrays
are the same, and each program compiles in a few seconds. The optimized HLO is per device
(SPMD-partitioned), so the shapes read from it are what one device allocates. The student's
saved activations are not vocabulary arrays (their last dimension is d_model).
"""

import math
import re

import jax
import jax.numpy as jnp
import pytest

from distill import handoff
from distill.config.load import load_config
from distill.errors import DistillError
from distill.handoff import eval_rows
from distill.limits import MAX_ELEMENTS, rows_that_fit
from distill.mesh import build_meshes, teacher_mesh
from distill.models import model
from pipelines.commands import score
from pipelines.plan import memory as plan_memory
from student import eval_programs, train
from teacher import sharding
from teacher.forward import forward_for

PATH = "pipelines/llama3-8b-to-1b.yaml"
LONG = "pipelines/llama3-8b-to-1b-32k.yaml"  # 32,768-token rows, cp in the student
DOCUMENT = 32768  # tokens of the document `distill score` reads
SHAPE = re.compile(r"\b(?:pred|bf16|[fsuc]\d+)\[([\d,]*)\]")
SORTS = re.compile(r"\b(?:sort|topk)\(|custom_call_target=\"[^\"]*[Tt]op[Kk]")


def _cfg(rows: int, top_k: int | None, *more: str, path: str = PATH):
    sets = [
        *more,
        "mesh.platform=cpu",
        "teacher.model.n_layers=1",
        "student.model.n_layers=1",
        f"train.batch_size={4 * rows}",  # 4 devices a role
        f"teacher.top_k={'null' if top_k is None else top_k}",
    ]
    cfg = load_config(path, sets)
    cfg.resolve_dtypes("cpu")
    return cfg


def oversized(hlo: str, vocab: set[int]) -> set[str]:
    """The arrays of a compiled program's HLO text at or past MAX_ELEMENTS: those whose last
    dimension is in `vocab`, and every operand and result of a sort or top-k."""
    found = set()
    for line in hlo.splitlines():
        sort = SORTS.search(line) is not None
        for dims in SHAPE.findall(line):
            shape = tuple(int(d) for d in dims.split(",") if d)
            if shape and (sort or shape[-1] in vocab) and math.prod(shape) >= MAX_ELEMENTS:
                found.add(f"{'sort ' if sort else ''}{list(shape)}: {line.strip()[:160]}")
    return found


def _check(compiled, vocab: int, what: str, tp: int = 1):
    """No oversized array in `compiled`, whose vocabulary arrays end in V or V / tp."""
    text, ends = compiled.as_text(), {vocab, vocab // tp}
    assert SHAPE.search(text), what  # shapes are read from this text
    assert not oversized(text, ends), (what, sorted(oversized(text, ends))[:5])


def _teacher_and_student(cfg, meshes, what: str):
    v, tp = cfg.teacher.model.vocab_size, cfg.mesh.teacher.tp
    compiled, out = plan_memory._teacher(cfg, meshes.teacher, None)
    _check(compiled, v, f"teacher {what}", tp)
    compiled, _ = plan_memory._student(cfg, meshes.student, out, None)
    _check(compiled, v, f"student step from {what}")


def test_the_check_finds_a_vocabulary_array_past_the_bound():
    """The dense forward at 8 rows a device in one array (no microbatches to split it by),
    as it compiles without the refusal, holds its [8, 4096, 128256] output whole: what the
    check must find (and what validate refuses)."""
    cfg = _cfg(8, None, "train.grad_accum=1")
    assert handoff.dense_blocks(cfg) == 1
    compiled, _ = plan_memory._teacher(cfg, build_meshes(cfg).teacher, None)
    found = oversized(compiled.as_text(), {cfg.teacher.model.vocab_size})
    assert any(f.startswith("[8, 4096, 128256]") for f in found), found
    assert oversized("%s = (f32[8,2147483648]{1,0}) sort(f32[8,2147483648]{1,0} %p)", set())


@pytest.mark.parametrize("rows", [8, 16])
def test_top_k_programs_hold_the_bound(rows):
    cfg = _cfg(rows, 64)
    assert handoff.dense_rows_per_device(cfg) == rows
    _teacher_and_student(cfg, build_meshes(cfg), f"top-64 at {rows} rows")


@pytest.mark.parametrize("rows", [8, 16])
def test_a_dense_output_is_made_in_blocks_that_hold_the_bound(rows):
    """Past the bound the dense output is handed over in one block per microbatch
    (train.grad_accum: 4 in the shipped layout, 2 or 4 rows a device each); in one array
    (grad_accum 1) it is refused, naming the rows that fit."""
    fit = rows_that_fit(4096, 128256)
    assert fit == 4  # 4 x 4096 x 128256 = 2.10e9 < 2^31 <= 5 x ...
    with pytest.raises(DistillError, match=f"^teacher.top_k: null .*; at most {fit} rows a device"):
        handoff.check_dense_elements(_cfg(rows, None, "train.grad_accum=1"))
    cfg = _cfg(rows, None)
    handoff.check_dense_elements(cfg)
    assert handoff.dense_blocks(cfg) == cfg.train.grad_accum == 4
    _teacher_and_student(cfg, build_meshes(cfg), f"dense in 4 blocks at {rows} rows")


def test_evaluation_and_scoring_programs_hold_the_bound():
    """The teacher's eval logits and the student's eval metrics on an eval chunk, the
    on-policy teacher's target log-probs, `distill score` of both models on a long
    document."""
    cfg = _cfg(16, 64)
    meshes = build_meshes(cfg)
    v, mcfg = cfg.teacher.model.vocab_size, cfg.teacher.model
    rows, tparams = eval_rows(cfg), plan_memory.teacher_params(cfg, meshes.teacher)
    put = sharding.batch_sharding(meshes.teacher)
    kw = {"dtype": cfg.teacher.dtype, "vocab_limit": None, "microbatch": cfg.teacher.microbatch}
    for mode in ("logits", "target_logprobs"):
        fwd = forward_for(mcfg, meshes.teacher, mode=mode, **kw)
        batch = plan_memory.abstract_batch(cfg, put, rows)
        _check(fwd.lower(tparams, batch).compile(), v, f"teacher {mode} at {rows} eval rows")
        logits = jax.eval_shape(fwd, tparams, batch)

    split = train.batch_sharding(meshes.student)
    scfg = cfg.student_model()
    tx, _ = train.distill_step_for(cfg, meshes.student)
    params = train.abstract_state(scfg, tx, meshes.student).params
    batch = plan_memory.abstract_batch(cfg, split, rows)
    logits = jax.ShapeDtypeStruct((rows, cfg.train.seq_len, v), jnp.float32, sharding=split)
    metrics = eval_programs.eval_fn_for(scfg, meshes.student, cfg.student.dtype, None)
    _check(metrics.lower(params, batch, logits).compile(), v, "student eval")

    one = teacher_mesh(jax.devices()[:1], 1, 1)
    doc = plan_memory.abstract_batch(cfg, sharding.batch_sharding(one), 1, DOCUMENT)
    fwd = forward_for(mcfg, one, mode="target_logprobs", dtype=cfg.teacher.dtype)
    _check(fwd.lower(plan_memory.teacher_params(cfg, one), doc).compile(), v, "teacher score")
    flat = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), doc)
    program = score.student_program(cfg, None)
    _check(program.lower(model.abstract_params(scfg), flat).compile(), v, "student score")


def test_the_online_teacher_makes_a_dense_output_in_the_microbatches_blocks(tiny_run, monkeypatch):
    """With the bound lowered below the tiny run's dense output (2 rows x 32 x 260 ids a
    device), `OnlineTeacher.output` hands it over in train.grad_accum blocks, block j the
    whole output's rows j, j + n, ... (the student's microbatch j: tests/test_fsdp.py)."""
    import numpy as np

    from distill.config.load import config_from_dict
    from distill.data.tokenizers import ByteTokenizer
    from distill.types import Batch
    from teacher.online import OnlineTeacher

    tree = {**tiny_run.tree, "train": {**tiny_run.tree["train"], "grad_accum": 2}}
    tree["teacher"] = {**tree["teacher"], "top_k": None, "pretrain_steps": 0}
    cfg = config_from_dict(tree)
    cfg.resolve_dtypes("cpu")
    teacher = OnlineTeacher(cfg, build_meshes(cfg).teacher, ByteTokenizer())
    rng = np.random.default_rng(0)
    ones = np.ones((4, 32), np.int32)
    tokens = rng.integers(0, 256, (4, 32)).astype(np.int32)
    positions = np.tile(np.arange(32, dtype=np.int32), (4, 1))
    batch = Batch(tokens, tokens, ones, positions, ones.astype(np.float32))
    whole, _ = teacher.output(batch)
    assert handoff.dense_blocks(cfg) == 1 and whole.logprobs.shape == (4, 32, 260)
    monkeypatch.setattr(handoff, "MAX_ELEMENTS", 2 * 32 * 260)  # 2 rows a device: not under it
    handoff.check_dense_elements(cfg)  # blocks of 1 row a device are
    blocks, _ = teacher.output(batch)
    assert handoff.dense_blocks(cfg) == 2 and isinstance(blocks.logprobs, tuple)
    for j, block in enumerate(blocks.logprobs):
        np.testing.assert_allclose(block, np.asarray(whole.logprobs)[j::2], atol=1e-6)


def test_score_of_the_student_in_chunks_is_its_whole_log_softmax(tmp_path, monkeypatch):
    """`distill score`'s student program, 5 positions at a time (32 = 6 x 5 + a last chunk
    shifted back), on a vocabulary padded past the tokenizer's: the targets' log-probs of
    the whole logits' log-softmax."""
    import numpy as np

    from distill.collectives import mask_vocab
    from distill.config.load import config_from_dict
    from distill.models import vocab_loss
    from tests.conftest import tiny_config

    cfg = config_from_dict(tiny_config(str(tmp_path), str(tmp_path / "out")))
    cfg.resolve_dtypes("cpu")
    scfg, limit = cfg.student_model(), 200
    params = model.init_params(scfg, 0)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, scfg.vocab_size, (1, 32)).astype(np.int32)
    ones = np.ones((1, 32), np.int32)
    positions = np.arange(32, dtype=np.int32)[None]
    batch = plan_memory.Batch(tokens, tokens, ones, positions, ones.astype(np.float32))
    z = mask_vocab(model.apply(scfg, params, tokens, ones, positions), limit, None)
    want = np.take_along_axis(np.asarray(jax.nn.log_softmax(z)), tokens[..., None], -1)[..., 0]
    assert np.isneginf(want).any() and np.isfinite(want).any()  # padded ids among the targets
    monkeypatch.setattr(vocab_loss, "default_chunk", lambda vocab, rows: 5)
    got = score.student_program(cfg, limit)(params, batch)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_evaluation_of_32k_rows_holds_the_bound():
    """The long-context pipeline's evaluation (`LONG`, at its own layout and batch): a row
    of 32,768 tokens x 128,256 ids is 4.2e9 elements, so the teacher makes an eval chunk's
    logits in position windows (`eval_windows`) and the student, its rows split over cp,
    compares each with its own; no program holds an array past the bound, and the student's
    does not copy the logits."""
    from distill.handoff import eval_windows
    from student import eval_programs

    cfg = load_config(LONG, ["mesh.platform=cpu", "teacher.model.n_layers=1",
                             "student.model.n_layers=1"])  # fmt: skip
    cfg.resolve_dtypes("cpu")
    s, v = cfg.train.seq_len, cfg.teacher.model.vocab_size
    rows, w = eval_rows(cfg), eval_windows(cfg)
    assert s == 32768 and s * v >= MAX_ELEMENTS and cfg.mesh.student.cp > 1
    assert w > 1 and rows * (s // w) * v < MAX_ELEMENTS
    meshes = build_meshes(cfg)
    mcfg, tparams = cfg.teacher.model, plan_memory.teacher_params(cfg, meshes.teacher)
    kw = {"dtype": cfg.teacher.dtype, "microbatch": cfg.teacher.microbatch, "windows": w}
    fwd = forward_for(mcfg, meshes.teacher, mode="logits", **kw)
    batch = plan_memory.abstract_batch(cfg, sharding.batch_sharding(meshes.teacher), rows)
    _check(fwd.lower(tparams, batch).compile(), v, f"teacher logits, {w} windows of {rows} rows")

    split = train.batch_sharding(meshes.student)
    scfg = cfg.student_model()
    tx, _ = train.distill_step_for(cfg, meshes.student)
    params = train.abstract_state(scfg, tx, meshes.student).params
    batch = plan_memory.abstract_batch(cfg, split, rows)
    window = jax.ShapeDtypeStruct((rows, s // w, v), jnp.float32, sharding=split)
    metrics = eval_programs.eval_fn_for(scfg, meshes.student, cfg.student.dtype, None)
    compiled = metrics.lower(params, batch, (window,) * w).compile()
    _check(compiled, v, "student eval, windows")
    # the logits stay where they land (each device's row-order slice), never laid out again
    # as the step's load-balanced pieces: the temporaries are under the logits' own bytes
    logits_bytes = rows * s * v * 4 // cfg.mesh.student.cp
    assert compiled.memory_analysis().temp_size_in_bytes < logits_bytes
