"""`pipeline.mode: local`: one process owns both meshes; JAX's async dispatch overlaps them.

The loop is `pipelines.loop.Loop`; here it is wired to its parts: the online teacher source
over the teacher's running object (`teacher.online`; a server's, `teacher.endpoint`; or the
offline cache), the student's
executor on the training mesh (`student.executor`) and the run's hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

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
from pipelines.sources import CacheSource, EndpointSource, OnlineSource
from pipelines.teachers import MultiSource
from student.executor import LocalExecutor, student_executor
from student.generate import sampler_for
from teacher.endpoint import EndpointTeacher
from teacher.online import OnlineTeacher
from teacher.weights import student_init_params

log = logging.getLogger("distill")


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


def teacher_source(cfg: Config, corpus: Corpus, meshes: Meshes, executor: LocalExecutor):
    """(the source of `cfg.teacher`'s outputs, the evaluation's sample metrics or None): the
    cache, a server, or the teacher online on the inference mesh."""
    if cfg.teacher.source == "cache":
        return CacheSource(cfg), None
    if cfg.teacher.source == "endpoint":
        vocab = min(corpus.tokenizer.vocab_size, *cfg.vocab_sizes())  # padded ids: never
        log.info("teacher: %s (%s API); evaluation takes the student's held-out figures "
                 "alone (a server gives no dense logits)", cfg.teacher.endpoint.url,
                 cfg.teacher.endpoint.api)  # fmt: skip
        return EndpointSource(cfg, corpus, EndpointTeacher(cfg, corpus.tokenizer, vocab)), None
    teacher = OnlineTeacher(cfg, meshes.teacher, corpus.teacher_tokenizer)
    if cfg.teachers:  # one of several: its batches alone (no on-policy steps)
        return OnlineSource(cfg, corpus, teacher), None
    return online_sources(cfg, corpus, teacher, executor, meshes.student)


def distill_local(
    cfg: Config, corpus: Corpus, meshes: Meshes, store: MetricsStore, extra: Sequence[h.Hook] = ()
) -> dict:
    """Distil the student; returns the summary written to summary.json. `extra`: hooks
    after the run's own."""
    executor = student_executor(cfg, corpus, meshes.student, student_init_params)
    if cfg.teachers:  # several: each its own source, in step (`pipelines.teachers`)
        each = [teacher_source(one, corpus, meshes, executor)[0] for one in cfg.each_teacher()]
        source, samples = MultiSource(cfg, each), None
        log.info("teachers: %s; %s; evaluation takes the student's held-out figures alone",
                 ", ".join(t.name for t in cfg.teachers),
                 f"records routed by '{cfg.data.teacher_field}'" if cfg.data.teacher_field
                 else "the divergence to each at its weight")  # fmt: skip
    else:
        source, samples = teacher_source(cfg, corpus, meshes, executor)
    evaluate = Evaluation(cfg, eval_batches(cfg, corpus), source, executor, samples)
    if meshes.platform == "cpu":  # the devices' RAM is the host's: give back one-off work's
        extra = [h.ReleaseHostMemory(cfg.train.eval_every), *extra]
    hooks = distill_hooks(cfg, evaluate, store, source, extra)
    stop = next(hk for hk in hooks if isinstance(hk, h.StopRequests))
    for one in getattr(source, "sources", [source]):
        if isinstance(one, EndpointSource):  # a stop ends a wait for the server
            one.interrupted = lambda: stop.sigterm.is_set() or store.stop_requested()
    record = partial(distill_record, teachers=tuple(t.name for t in cfg.teachers))
    try:
        return Loop(LoopSpec.of(cfg), source, executor, hooks, record=record, store=store).run()
    finally:
        source.close()
        executor.close()
