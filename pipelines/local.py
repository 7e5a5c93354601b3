"""`pipeline.mode: local`: one process owns both meshes; JAX's async dispatch overlaps them.

The loop is `pipelines.loop.Loop`; here it is wired to its parts: the online teacher source
over the teacher's running object (`teacher.online`, or the offline cache), the student's
executor on the training mesh (`student.executor`) and the run's hooks.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import Mesh

from distill import outputs
from distill.config import Config
from distill.data.corpus import Corpus
from distill.data.tokenizers import vocab_limit
from distill.mesh import Meshes
from distill.observability.metrics import MetricsStore
from pipelines import hooks as h
from pipelines.alpha_gate import AlphaGate
from pipelines.divergence import Divergence
from pipelines.evaluation import Evaluation, eval_batches
from pipelines.loop import Loop, LoopSpec
from pipelines.memory_guard import HostMemoryGuard
from pipelines.on_policy import OnPolicySource, sample_score
from pipelines.progress import distill_record
from pipelines.sources import CacheSource, OnlineSource
from student.executor import LocalExecutor, student_executor
from student.generate import sampler_for
from teacher.online import OnlineTeacher
from teacher.weights import student_init_params


def distill_hooks(
    cfg: Config, evaluate, store, source, extra: Sequence[h.Hook] = ()
) -> list[h.Hook]:
    """The hooks of a distillation run, local and ray modes alike: records, progress, the
    divergence and host-memory guards, evaluation (`evaluate`, a
    `pipelines.evaluation.Evaluation`), the divergence's weight following it
    (`distill.alpha_gate`), checkpoints, stop requests, status, the profile if asked for,
    then `extra` (ray's own status, tests' faults)."""
    evaluations = h.Evaluate(evaluate, cfg.train.eval_every)
    gate = [AlphaGate(cfg.distill.alpha, evaluations)] if cfg.distill.alpha_gate else []
    hooks = [
        h.Records(),
        h.ProgressBar(cfg.run.name),
        Divergence(cfg.train.max_nonfinite_steps),
        HostMemoryGuard(cfg.train.min_free_host_memory_gib),
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
    executor = student_executor(cfg, corpus, meshes.student, student_init_params)
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
