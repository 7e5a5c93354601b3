"""Several teachers for one student (`teachers:`): how the list becomes the run's teachers
at load (`resolve_teachers`), and what a run with several cannot do yet (`check_teachers`,
refused by validate before any device work). docs/guides/several-teachers.md."""

from __future__ import annotations

from collections.abc import Callable

from distill.errors import DistillError


def resolve_teachers(cfg, resolve: Callable) -> None:
    """`teacher` resolved (`resolve(config)`: its format, a Hugging Face teacher's shape);
    or, `teachers` given, each resolved so, the first made `teacher` too; a `teacher` written beside
    them must be that first one (as a run's own config.yaml writes it). The alpha gate is off
    unless set (on, it follows the teachers' combined held-out figures)."""
    if not cfg.teachers:
        for key, given in (("teacher_field", cfg.data.teacher_field is not None),
                           ("teacher_batches", cfg.data.teacher_batches != "mixed")):  # fmt: skip
            if given:
                raise DistillError(
                    f"data.{key}: routes records to one of several teachers; set teachers: "
                    "(two or more) or remove it"
                )
        resolve(cfg)
        return
    names = [t.name for t in cfg.teachers]
    if len(names) < 2:
        raise DistillError(
            "teachers: one teacher given; write it as teacher: (teachers: is for two or more)"
        )
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise DistillError(f"teachers: the name '{twice}' is given twice; each needs its own")
    first = cfg.teachers[0]
    if "teacher" in cfg.model_fields_set:
        own = cfg.teacher.model_dump()
        if own != first.model_dump(exclude={"name", "weight"}):
            raise DistillError(
                "teacher: set beside teachers:; give the teachers as teachers: alone (the "
                "first is the run's teacher)"
            )
    for t in cfg.teachers:
        resolve(cfg.model_copy(update={"teacher": t}))
    cfg.teacher = first
    if "alpha_gate" not in cfg.distill.model_fields_set:
        cfg.distill.alpha_gate = False


# What a run with several teachers cannot do yet: (key, is it asked for, why).
def _refused(cfg) -> list[tuple[str, bool, str]]:
    own_tokenizer = [
        i for i, t in enumerate(cfg.teachers) if t.tokenizer not in (None, cfg.data.tokenizer)
    ]
    cached = [i for i, t in enumerate(cfg.teachers) if t.source == "cache"]
    return [
        ("pipeline.mode", cfg.pipeline.mode == "ray",
         "several teachers run in pipeline.mode local (the Ray teacher pool holds one)"),
        ("distill.on_policy.fraction", cfg.distill.on_policy.fraction > 0,
         "scoring the student's samples by several teachers is not built yet"),
        (f"teachers[{own_tokenizer[0] if own_tokenizer else 0}].tokenizer", bool(own_tokenizer),
         "several teachers share data.tokenizer (a teacher with its own tokenizer among "
         "several is not built yet)"),
        (f"teachers[{cached[0] if cached else 0}].source", bool(cached),
         "several teachers run online or behind an endpoint (a cache holds one teacher's "
         "outputs)"),
        ("distill.alpha_gate", cfg.distill.alpha_gate and not all(t.loaded() for t in cfg.teachers),
         "the gate compares the teachers' held-out figures with the student's, which a "
         "teacher behind a server does not give; set it false"),
        ("data.teacher_batches",
         cfg.data.teacher_batches == "grouped"
         and (cfg.data.teacher_field is None or any(t.top_k is None for t in cfg.teachers)),
         "grouped batches need data.teacher_field and every teacher's top_k (a teacher's "
         "batches without its rows take zeros of its top-k's shape)"),
        ("data.prepared_dir", cfg.data.teacher_field is not None and bool(cfg.data.prepared_dir),
         "routed records are read from data.source (a prepared corpus keeps no route)"),
    ]  # fmt: skip


def check_teachers(cfg) -> None:
    """One DistillError line for what several teachers cannot do yet; nothing with one."""
    if not cfg.teachers:
        return
    for key, bad, why in _refused(cfg):
        if bad:
            raise DistillError(f"{key}: not supported with several teachers; {why}")


def for_each(cfg, check: Callable, indexed: bool = False) -> None:
    """`check(config)` (`indexed`: `check(config, i)`) of each teacher's config
    (`Config.each_teacher`); with several, a refusal naming `teacher.<key>` names
    `teachers[i].<key>` instead."""
    for i, one in enumerate(cfg.each_teacher()):
        try:
            check(one, i) if indexed else check(one)
        except DistillError as e:
            text = str(e)
            if cfg.teachers and text.startswith("teacher."):
                raise DistillError(f"teachers[{i}].{text[len('teacher.') :]}") from None
            raise
