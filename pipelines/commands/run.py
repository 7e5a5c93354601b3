"""The entry points behind the CLI: run, validate, plan, eval."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from distill import outputs
from distill.config import Config
from distill.data.routed import teacher_corpus
from distill.data.tokenizers import vocab_limit
from distill.errors import DistillError
from distill.mesh import Meshes, build_meshes, colocated
from distill.observability.metrics import MetricsStore
from distill.observability.metrics_log import dumps
from pipelines import placement
from pipelines.bootstrap import ensure_teacher
from pipelines.hooks import Hook
from pipelines.plan import flops as plan_flops
from pipelines.plan import format_plan, host_memory, plan
from pipelines.plan import memory as plan_memory
from pipelines.preflight import preflight, preflight_shapes
from pipelines.teacher_checks import uses_teacher
from teacher.stages import check_stages

log = logging.getLogger("distill")


def _require_ray(cfg: Config) -> None:
    if cfg.pipeline.mode != "ray":
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        raise DistillError(
            "pipeline.mode: ray needs Ray installed: pip install 'distill[ray]'"
        ) from None


def check_run(cfg: Config, unavailable: list[str] | None = None) -> tuple[Config, Meshes, object]:
    """Everything `distill run` refuses before device work, in the order it meets them:
    `distill validate` is this call, so what validate says is what run does. Returns (the
    config as this process runs it: ray mode's driver view on CPU, or `cfg` resolved in
    place; its meshes; the corpus). `unavailable` (validate's): collects a teacher this
    machine cannot bootstrap instead of raising (`preflight`); the host's memory is then
    not checked, the run being one this machine cannot start anyway."""
    _require_ray(cfg)
    host_cfg = cfg
    if cfg.pipeline.mode == "ray":  # the driver stays on CPU; the actors own the devices
        from pipelines.ray.mode import driver_view

        host_cfg = driver_view(cfg)
    meshes, corpus = validate(host_cfg, unavailable)
    if not unavailable:  # compiles both programs: after the cheaper checks
        _check_host(cfg, meshes, corpus)
    return host_cfg, meshes, corpus


def validate(cfg: Config, unavailable: list[str] | None = None) -> tuple[Meshes, object]:
    """The checks of `preflight`, the teacher cache, and on an accelerator the devices'
    memory; returns (meshes, corpus). `check_run` adds the host's memory on CPU devices."""
    corpus = preflight(cfg, unavailable)
    if cfg.teacher.source == "cache":  # offline: the cache must match and be long enough
        from pipelines.offline.teacher_cache import check_cache

        check_cache(cfg, corpus)
    meshes = build_meshes(cfg)
    if plan_memory.device_memory(meshes.student) is not None:  # an accelerator: do both fit?
        mem = _memory(cfg, meshes, corpus.tokenizer)  # resolves train.remat: auto
        log.info(
            "student blocks: train.remat: %s (%s)", cfg.train.remat, mem["student"]["remat_reason"]
        )
        plan_memory.check_fits(mem, cfg)
        placement.check_colocated_fits(mem)
        plan_flops.check_moe(cfg, mem["teacher"])
    else:  # CPU: auto is `none`, nothing to compile (`student.remat`)
        plan_memory.resolve_remat(cfg, meshes.student)
    return meshes, corpus


def _check_host(cfg: Config, meshes: Meshes, corpus) -> None:
    """Before a command loads both models into this process's CPU devices: does the sum
    over the devices fit the machine (`pipelines.plan.host_memory`)? `plan` leaves it out
    (it plans a layout for any machine, such as a GPU host's from a laptop: it prints the
    sum instead); `validate` and `run` check it (`check_run`)."""
    if cfg.pipeline.mode == "local":
        host_memory.check_host_fits(cfg, meshes, lambda c, m: _memory(c, m, corpus.tokenizer))


def _tokenizer_if_present(cfg: Config):
    from distill.data.tokenizers import build_tokenizer

    try:
        return build_tokenizer(cfg.data)
    except DistillError:
        return None


def _memory(cfg: Config, meshes: Meshes, tokenizer) -> dict:
    limit = vocab_limit(tokenizer, *cfg.vocab_sizes()) if tokenizer else None
    mem = plan_memory.memory(cfg, meshes, limit)
    if colocated(cfg):  # both roles on each device
        mem["colocated"] = placement.colocated_memory(cfg, mem)
    return mem


def _start_server(cfg: Config, store: MetricsStore):
    if not cfg.server.enabled:
        return None
    from distill.observability.server.runner import start_server

    try:
        handle = start_server(store, cfg.server)
    except OSError as e:
        raise DistillError(
            f"server.port: cannot listen on {cfg.server.host}:{cfg.server.port}: {e.strerror or e}"
        ) from None
    handle.announce(outputs.out_dir(cfg))  # `distill dashboard` on the run finds it
    log.info("dashboard: %s", handle.url)
    return handle


def run(cfg: Config, extra: Sequence[Hook] = ()) -> dict:
    """`distill run`: preflight, server, teacher (load or bootstrap), distil, summary.
    `extra`: hooks the distillation loop runs after its own (tests inject faults so). A run
    that diverged returns its summary with its `failure` (the caller's exit status)."""
    host_cfg, meshes, corpus = check_run(cfg)  # nothing written before it
    p = plan(cfg, meshes)
    log.info("plan:\n%s", format_plan(p))
    outputs.write_config(cfg)
    from distill.observability.tracking import (
        metric_sinks,  # TensorBoard, W&B: what the config asks for
    )

    store = MetricsStore(
        cfg.run.name,
        cfg.train.steps,
        cfg.model_dump(mode="json"),
        output_dir=str(outputs.out_dir(cfg)),
        stall_timeout_s=cfg.server.stall_timeout_s,
        sinks=metric_sinks(cfg),
    )
    store.set_mesh(p["layout"])
    server = _start_server(cfg, store)
    try:
        for i, one in enumerate(host_cfg.each_teacher()):  # each on its own records
            if uses_teacher(one):
                ensure_teacher(one, teacher_corpus(corpus, i), store)
        if cfg.pipeline.mode == "ray":
            from pipelines.ray.mode import distill_ray

            summary = distill_ray(cfg, corpus, store, extra)
        else:
            from pipelines.local import distill_local

            summary = distill_local(cfg, corpus, meshes, store, extra)
        summary = {
            "run": cfg.run.name,
            "plan": {k: v for k, v in p.items() if k != "layout"},
            **summary,
        }
        outputs.write_summary(cfg, summary)
        if summary.get("failure"):  # /healthz 503 with the reason, W&B marked failed
            store.fail(summary["failure"], summary)
        else:
            store.finish(summary)
        return summary
    except BaseException as e:
        store.fail(f"{type(e).__name__}: {e}")
        raise
    finally:
        if server is not None:
            if os.environ.get("DISTILL_HOLD_SERVER_S"):  # keep the dashboard up for a look
                time.sleep(float(os.environ["DISTILL_HOLD_SERVER_S"]))
            server.stop()
        store.close()  # on a bucket, this writes the metrics.jsonl lines not uploaded yet


def evaluate(cfg: Config) -> dict:
    """`distill eval`: the teacher and the latest student checkpoint on the held-out split."""
    from distill.checkpoint import has_checkpoint
    from pipelines.evaluation import eval_batches
    from pipelines.on_policy import SAMPLE_KEYS, sample_score
    from student.executor import student_executor
    from teacher.online import OnlineTeacher
    from teacher.weights import student_init_params

    if cfg.teachers:
        raise DistillError(
            "teachers: distill eval compares the student with one teacher; give it a config "
            "whose teacher: is the one to compare with"
        )
    if cfg.teacher.source == "endpoint":
        raise DistillError(
            "teacher.source: endpoint: distill eval compares the student with the teacher's "
            "dense logits, which a server does not give; run it with teacher.source: online"
        )
    _, meshes, corpus = check_run(cfg)
    if not has_checkpoint(outputs.checkpoint_dir(cfg)):
        where = outputs.checkpoint_dir(cfg)
        raise DistillError(f"run.output_dir: no student checkpoint in {where}")
    executor = student_executor(cfg, corpus, meshes.student, student_init_params)
    step, _ = executor.start()
    try:
        teacher = OnlineTeacher(cfg, meshes.teacher, corpus.tokenizer)
        batches = eval_batches(cfg, corpus)
        result = executor.evaluate(batches, teacher.eval_logits(batches), keep=False)
        result.update(sample_score(cfg, corpus, teacher, meshes.student)(executor.state.params))
    finally:
        executor.finish()
    keys = ("teacher_loss", "student_loss", "kl", "top1_agreement", *SAMPLE_KEYS)
    return {"step": step, **{k: result[k] for k in keys}}


def _cpu_plan_note(cfg: Config, auto_dtypes: list[str], auto_remat: bool) -> str:
    """The one line that labels a CPU plan's figures: this machine's backend, the dtypes and
    remat they were compiled in, and what the config left to the platform (`auto` dtypes:
    float32 here; `train.remat: auto`: none here), which a GPU or TPU decides otherwise."""
    parts = [f"{r}.dtype auto as float32 (bfloat16 on a GPU or TPU)" for r in auto_dtypes]
    if auto_remat:
        parts.append(f"train.remat auto as {cfg.train.remat} (an accelerator's memory decides)")
    compiled = (
        f"teacher {cfg.teacher.dtype}, student {cfg.student.dtype}, train.remat {cfg.train.remat}"
    )
    line = f"note: planned on CPU devices: the figures are XLA:CPU's, compiled in {compiled}"
    if not parts:
        return line
    left = "; ".join(parts)
    return f"{line} ({left}): an accelerator's differ; set these fields to plan as it would"


def plan_json(cfg: Config) -> str:
    """`distill plan`: the plan with both roles' compiled per-device memory. From shapes
    alone: no data is read and no weights are loaded (the tokenizer, if its file is here,
    only tells how much of the vocabulary is padding), so a laptop can plan a pod's run."""
    _require_ray(cfg)
    check_stages(cfg, warn=False)
    auto_dtypes = [r for r in ("teacher", "student") if getattr(cfg, r).dtype == "auto"]
    auto_remat = cfg.train.remat == "auto"  # resolved by the memory plan below
    table = preflight_shapes(cfg, log_table=False)
    meshes = build_meshes(cfg)
    mem = _memory(cfg, meshes, _tokenizer_if_present(cfg))
    p = plan_memory.add_to_plan(plan(cfg, meshes), mem)
    text = [format_plan(p)]
    if meshes.platform == "cpu":  # label the figures before they come
        text.append(_cpu_plan_note(cfg, auto_dtypes, auto_remat))
    text += [plan_memory.format_memory(mem), plan_flops.format_flops(p)]
    if "colocated" in mem:
        p["colocated"] = mem["colocated"]
        text.append(placement.format_colocated(mem))
    if meshes.platform == "cpu":  # the devices share this machine's RAM: their sum
        p["host_memory"] = host_memory.host_figures(meshes, mem, host_memory.available_bytes(), cfg)
        text.append(host_memory.format_host(p["host_memory"]))
    text = "\n".join([*text, dumps(p)])
    return text if table is None else table + "\n" + text
