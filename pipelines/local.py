"""`pipeline.mode: local`: one process owns both meshes; JAX's async dispatch overlaps them.

The loop is `pipelines.loop.Loop`; here it gets its parts: the online teacher source on the
inference mesh (or the offline cache), and the jitted student step on the training mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import Mesh

from distill import outputs
from distill.config import Config
from distill.data.byte_paths import BytePaths
from distill.data.corpus import Corpus
from distill.data.token_bytes import FirstBytes, VocabMap, byte_lengths
from distill.data.tokenizers import vocab_limit
from distill.mesh import Meshes
from distill.models.cross_losses import CrossSpec
from distill.observability.metrics import MetricsStore
from pipelines import hooks as h
from pipelines.alpha_gate import AlphaGate
from pipelines.divergence import Divergence
from pipelines.evaluation import Evaluation, eval_batches
from pipelines.executors import LocalExecutor
from pipelines.loop import Loop, LoopSpec
from pipelines.on_policy import OnPolicySource, sample_score
from pipelines.progress import distill_record
from pipelines.sources import CacheSource, OnlineSource, OnlineTeacher
from student import train
from student.alpha import alpha_steps_for
from student.evaluate import StudentEval
from student.generate import ParamHistory, sampler_for
from student.state import run_checkpointer, start_student
from teacher.weights import student_init_params


def student_executor(cfg: Config, corpus: Corpus, mesh: Mesh) -> LocalExecutor:
    """The run's student on the training mesh: its state (resumed, or initialised), its
    compiled distillation step, its checkpoints and its side of evaluation; for on-policy
    runs, the recent parameters it generates with."""
    limit = vocab_limit(corpus.tokenizer, *cfg.vocab_sizes())
    cross = cross_spec(cfg, corpus)
    tx, step_fn = alpha_steps_for(cfg, mesh, vocab_limit=limit, cross=cross)
    ckpt = run_checkpointer(cfg)
    placed = train.param_shardings(cfg.student_model(), mesh)  # its weights read straight there
    history = None
    if cfg.distill.on_policy.fraction > 0:
        abstract = train.abstract_state(cfg.student_model(), tx, mesh).params
        history = ParamHistory(cfg.pipeline.max_staleness, abstract)
    return LocalExecutor(
        mesh,
        lambda: start_student(cfg, tx, mesh, ckpt, lambda: student_init_params(cfg, placed)),
        step_fn,
        ckpt=ckpt,
        evaluator=StudentEval(cfg, mesh, limit, eval_byte_lengths(cfg, corpus)),
        tokens_per_step=cfg.train.batch_size * cfg.train.seq_len,
        history=history,
    )


def cross_spec(cfg: Config, corpus: Corpus) -> CrossSpec | None:
    """How the step compares the two vocabularies of a cross-tokenizer run, else None."""
    if corpus.teacher is None:
        return None
    vmap, method = None, cfg.distill.cross_tokenizer
    if method in ("mapped", "first_byte", "byte_path"):
        kind = {"mapped": VocabMap, "first_byte": FirstBytes, "byte_path": BytePaths}[method]
        vmap = kind.between(
            corpus.teacher, corpus.tokenizer, cfg.teacher.model.vocab_size,
            cfg.student_model().vocab_size,
        )  # fmt: skip
    if cfg.distill.cross_boundary and method in ("first_byte", "byte_path"):
        vmap = vmap.after_tokens(*corpus.train.successions())
    return CrossSpec(method, vmap, corpus.teacher.vocab_size)


def eval_byte_lengths(cfg: Config, corpus: Corpus) -> tuple:
    """(student's, teacher's) bytes per id, for held-out bits per byte."""
    student = byte_lengths(corpus.tokenizer, cfg.student_model().vocab_size)
    return student, byte_lengths(corpus.teacher_tokenizer, cfg.teacher.model.vocab_size)


def distill_hooks(
    cfg: Config, evaluate, store, source, extra: Sequence[h.Hook] = ()
) -> list[h.Hook]:
    """The hooks of a distillation run, local and ray modes alike: records, progress, the
    divergence guard, evaluation (`evaluate`, a `pipelines.evaluation.Evaluation`), the
    divergence's weight following it (`distill.alpha_gate`), checkpoints, stop requests,
    status, the profile if asked for, then `extra` (ray's own status, tests' faults)."""
    evaluations = h.Evaluate(evaluate, cfg.train.eval_every)
    gate = [AlphaGate(cfg.distill.alpha, evaluations)] if cfg.distill.alpha_gate else []
    hooks = [
        h.Records(),
        h.ProgressBar(cfg.run.name),
        Divergence(cfg.train.max_nonfinite_steps),
        evaluations,
        *gate,
        h.Checkpoints(cfg.train.checkpoint_every),
        h.StopRequests(),
        h.Status(lambda step, _: store.update(step=step, in_flight=source.in_flight())),
    ]
    if cfg.train.profile is not None:
        first, n = cfg.train.profile
        hooks.append(h.Profile(first, n, str(outputs.out_dir(cfg) / "profile")))
    return [*hooks, *extra]


def online_sources(
    cfg: Config, corpus: Corpus, teacher: OnlineTeacher, executor: LocalExecutor, mesh: Mesh
):
    """(the teacher source, the evaluation's sample metrics) of a run with the teacher
    online: on-policy when `distill.on_policy.fraction` > 0, else the data's rows."""
    samples = None
    if corpus.teacher is None:  # the teacher scores the student's samples in its own tokens
        score = sample_score(cfg, corpus, teacher, mesh)
        samples = lambda: score(executor.state.params)  # noqa: E731
    if cfg.distill.on_policy.fraction == 0:
        return OnlineSource(cfg, corpus, teacher), samples
    limit = vocab_limit(corpus.tokenizer, *cfg.vocab_sizes())
    sampler = sampler_for(cfg, mesh, corpus.tokenizer, limit)
    return OnPolicySource(cfg, corpus, teacher, sampler, executor.history), samples


def distill_local(
    cfg: Config, corpus: Corpus, meshes: Meshes, store: MetricsStore, extra: Sequence[h.Hook] = ()
) -> dict:
    """Distil the student; returns the summary written to summary.json. `extra`: hooks
    after the run's own."""
    executor = student_executor(cfg, corpus, meshes.student)
    samples = None
    if cfg.teacher.source == "cache":
        source = CacheSource(cfg)
    else:
        teacher = OnlineTeacher(cfg, meshes.teacher, corpus.teacher_tokenizer)
        source, samples = online_sources(cfg, corpus, teacher, executor, meshes.student)
    evaluate = Evaluation(cfg, eval_batches(cfg, corpus), source, executor, samples)
    if meshes.platform == "cpu":  # the devices' RAM is the host's: give back one-off work's
        extra = [h.ReleaseHostMemory(cfg.train.eval_every), *extra]
    hooks = distill_hooks(cfg, evaluate, store, source, extra)
    try:
        return Loop(
            LoopSpec.of(cfg), source, executor, hooks, record=distill_record, store=store
        ).run()
    finally:
        source.close()
        executor.close()
