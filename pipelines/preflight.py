"""Everything a user can get wrong, checked before any device work or any write.

`preflight` is what `distill validate` runs, and what `distill run` runs first
(`pipelines.commands.run.check_run`): the config, the teacher checkpoint, the data, then
the layout, `mesh.placement: auto` choosing only among layouts that pass the same checks
(`check_layout`). Each failure is one DistillError naming the field or file.
"""

from __future__ import annotations

import functools
from pathlib import Path

from distill import storage
from distill.checkpoint import params_exist
from distill.config import Config
from distill.config.endpoint import check_endpoint
from distill.config.teachers import check_teachers, for_each
from distill.data.corpus import Corpus
from distill.data.cross.examples import cross_example_corpus
from distill.data.cross.rows import cross_corpus, row_multiple
from distill.data.loader import load_corpus
from distill.data.prompts import load_prompts, prompt_set
from distill.data.routed import routed_corpus, teacher_corpus
from distill.data.tokenizers import Tokenizer, load_tokenizer
from distill.errors import DistillError
from distill.handoff import check_dense_elements, check_dense_output, dense_blocks
from distill.mesh import (
    Placement,
    available_devices,
    check_batch_split,
    check_context,
    check_fit,
    check_hosts,
    check_placement_mode,
    check_teacher_split,
)
from distill.models.hf import files as hf_files
from pipelines.evaluation import check_eval_rows
from pipelines.on_policy import check_on_policy
from pipelines.placement import resolve
from pipelines.teacher_checks import (
    check_bootstrap_fits,
    check_student_pin,
    check_teacher_weights,
    uses_teacher,
)
from teacher import quantized
from teacher.sharding import check_divisible
from teacher.stages import check_stages


def check_shapes(cfg: Config) -> None:
    """The model shapes and the batch against the mesh axes (a layout's checks)."""
    t, tp = cfg.teacher.model, cfg.mesh.teacher.tp
    if cfg.teacher.is_hf():  # errors name config.json and the weight files, headers only
        hf_files.check_checkpoint(
            cfg.teacher.checkpoint, t, tp, quantized.quantized_shapes(cfg.teacher.checkpoint)
        )
    check_divisible(t, tp, ep=cfg.mesh.teacher.ep)
    check_batch_split(cfg)
    check_teacher_split(cfg)


def check_top_k(cfg: Config) -> None:
    t, s = cfg.teacher.model, cfg.student_model()
    # across tokenizers the top-k are the teacher's own ids: its vocabulary bounds them
    smallest = t.vocab_size if cfg.cross_tokenizer() else min(t.vocab_size, s.vocab_size)
    if cfg.teacher.top_k is not None and cfg.teacher.top_k > smallest:
        raise DistillError(
            f"teacher.top_k: {cfg.teacher.top_k} exceeds the smaller model vocabulary "
            f"({smallest}; teacher {t.vocab_size}, student {s.vocab_size})"
        )


def check_several_dense(cfg: Config) -> None:
    """Several teachers: a dense output handed over in blocks (one per microbatch,
    `distill.handoff.dense_blocks`) is not combined with the others' yet."""
    for i, one in enumerate(cfg.each_teacher()):
        if cfg.teachers and dense_blocks(one) > 1:
            raise DistillError(
                f"teachers[{i}].top_k: null makes a dense output too large for one array a "
                f"device ({dense_blocks(one)} blocks, one per train.grad_accum microbatch), "
                "which several teachers do not combine yet; set its top_k"
            )


def check_layout(cfg: Config, device) -> None:
    """Everything a run checks of one layout (the mesh axes), `device` one of the
    platform's: the shapes and the batch against the axes, the dense teacher output per
    student device, the evaluation's windows. `mesh.placement: auto` runs it on every
    candidate before it compiles any, so a run never compiles a layout it would refuse."""
    for_each(cfg, check_shapes)
    check_several_dense(cfg)
    check_dense_output(cfg, device)
    check_eval_rows(cfg)


def check_config(cfg: Config) -> None:
    """What no layout changes: the keys against the mode, context parallelism and stages,
    a teacher behind a server, on-policy steps, the teacher's tokenizer, the top-k against
    the vocabularies."""
    check_context(cfg)
    check_stages(cfg)
    check_mode(cfg)
    check_teachers(cfg)
    for_each(cfg, check_endpoint)  # before the checks below: their refusals would name less
    check_on_policy(cfg)
    check_cross_tokenizer(cfg)
    for_each(cfg, check_top_k)


def check_mode(cfg: Config) -> None:
    """Keys that the chosen pipeline mode cannot honour."""
    check_hosts(cfg)
    check_placement_mode(cfg)
    if cfg.train.profile is not None and cfg.pipeline.mode == "ray":
        raise DistillError(
            "train.profile: traces the devices of the process that runs the loop; in "
            "pipeline.mode ray those are the actors' (profile a local-mode run of the same config)"
        )
    if cfg.train.profile is not None and "://" in cfg.run.output_dir:
        raise DistillError(
            f"train.profile: the trace is written under run.output_dir, which must be local "
            f"for it ({cfg.run.output_dir})"
        )
    if cfg.pipeline.mode == "ray":
        if cfg.teacher.source == "cache":
            raise DistillError(
                "teacher.source: cache is read in pipeline.mode local; in pipeline.mode ray "
                "the teacher actors run the teacher online (set teacher.source: online)"
            )
        for role in ("teacher", "student"):
            if getattr(cfg.mesh, role).devices is not None:
                raise DistillError(
                    f"mesh.{role}.devices: not used in pipeline.mode ray, where Ray gives each "
                    "actor its devices; remove it"
                )


def check_teacher_source(cfg: Config) -> None:
    storage.check(cfg.teacher.checkpoint, "teacher.checkpoint")
    if not cfg.teacher.loaded() and cfg.student.init == "random":
        return  # the cache (or server) is checked apart; no teacher weights needed
    if params_exist(cfg.teacher.checkpoint) or cfg.teacher.pretrain_steps > 0:
        return
    where = cfg.teacher.checkpoint or "(not set)"
    raise DistillError(
        f"teacher.checkpoint: {where} has no weights and teacher.pretrain_steps is 0; "
        "point it at a teacher checkpoint or set teacher.pretrain_steps > 0 to train one"
    )


def check_output_dir(cfg: Config) -> None:
    out = cfg.run.output_dir
    storage.check(out, "run.output_dir")  # gs:// needs gcsfs; other schemes are refused
    if "://" not in out and Path(out).exists() and not Path(out).is_dir():
        raise DistillError(f"run.output_dir: {out} exists and is not a directory")


def _devices(cfg: Config) -> list:
    devices = available_devices(cfg.mesh.platform)
    cfg.resolve_dtypes(devices[0].platform)
    return devices


def _lay_out(cfg: Config, devices: list, log_table: bool = True) -> str | None:
    """`mesh.placement: auto` resolved among the layouts that pass `check_layout` (compiling
    only those), then the layout's own checks; auto's table, or None."""
    check = functools.partial(check_layout, device=devices[0])
    table = resolve(cfg, devices, log_table, check)
    check_fit(cfg, len(devices), devices[0].platform)
    check(cfg)
    return table


def preflight_shapes(cfg: Config, log_table: bool = True) -> str | None:
    """What `distill plan` needs: the config against the devices and the model shapes
    against the meshes; no data read, no weights looked at. Returns auto's table, or None."""
    devices = _devices(cfg)
    check_config(cfg)
    return _lay_out(cfg, devices, log_table)


def check_cross_tokenizer(cfg: Config) -> None:
    """A teacher tokenizer of its own (teacher.tokenizer) works with what is built for it:
    a dense or top-k teacher, online or from its cache, in local or ray mode, on-policy or
    not, with the teacher already trained (its bootstrap reads the data in its own tokens,
    which a cross-tokenizer corpus is not); its own chat template (teacher.chat_template)
    only for chat data across tokenizers."""
    if cfg.teacher.chat_template is not None and not (
        cfg.cross_tokenizer() and cfg.data.format == "chat"
    ):
        raise DistillError(
            "teacher.chat_template: read only for data.format: chat with a teacher.tokenizer "
            "of its own (else data.chat_template is both sides' template); remove it"
        )
    if not cfg.cross_tokenizer():
        return
    refused = [
        ("teacher.pretrain_steps", cfg.teacher.pretrain_steps > 0,
         "a trained teacher (pretrain_steps: 0; bootstrap it in a run with its tokenizer)"),
        ("train.grad_accum", cfg.train.grad_accum > 1, "grad_accum: 1"),
        ("teacher.source", cfg.teacher.source == "cache" and cfg.teacher.top_k is None,
         "teacher.top_k set, or teacher.source: online (a cache holds top-k outputs; a dense "
         "cross-tokenizer loss reads the teacher's whole distribution at its own tokens)"),
        ("distill.on_policy.fraction",
         cfg.distill.on_policy.fraction > 0 and cfg.data.is_examples,
         "text data (a sample of chat or prompt/completion data is not re-rendered with the "
         "teacher's template)"),
        ("distill.cross_tokenizer: byte_path",
         cfg.distill.cross_tokenizer == "byte_path" and cfg.teacher.tokenizer != "bytes",
         "a byte-level teacher (teacher.tokenizer: bytes): it reads the teacher's positions "
         "inside each student token"),
    ]  # fmt: skip
    for key, bad, needs in refused:
        if bad:
            raise DistillError(
                f"{key}: not supported with teacher.tokenizer={cfg.teacher.tokenizer} (another"
                f" tokenizer than data.tokenizer={cfg.data.tokenizer}) yet; needs {needs}"
            )


def preflight(cfg: Config, unavailable: list[str] | None = None) -> Corpus:
    """Everything a run refuses before device work, cheapest first: the config (and a
    layout given), the teacher source, the output directory, a teacher to bootstrap against
    the host, the data (rows enough for a batch, vocabularies, prompts), the teacher weights
    and the student checkpoint's teacher (`pipelines.teacher_checks`); `mesh.placement:
    auto` compiles its candidates only after all of these. Returns the corpus.

    `unavailable` (validate's): where given, a teacher this machine cannot bootstrap (no
    weights here, too large to train here) is appended to it, as what stops a run on this
    machine, and every other check still runs: a pod's config validates on a laptop."""
    devices = _devices(cfg)
    check_config(cfg)
    auto = cfg.mesh.placement == Placement.AUTO
    if not auto:  # a layout given: its checks are cheap, before the data is read
        _lay_out(cfg, devices)
    for_each(cfg, check_teacher_source)
    check_output_dir(cfg)
    for_each(cfg, lambda one: _bootstrap_fits(one, unavailable))
    corpus = _corpus(cfg)
    check_rows(cfg, corpus)
    if cfg.distill.on_policy.fraction > 0 and cfg.data.format == "chat":
        prompt_set(cfg, corpus.tokenizer)  # every prompt renders
    elif cfg.distill.on_policy.fraction > 0 and cfg.data.prompt_field is not None:
        load_prompts(cfg.data)  # the field is there, in JSONL or Parquet records
    for_each(cfg, lambda one, i: _teacher_weights(one, teacher_corpus(corpus, i)), indexed=True)
    check_student_pin(cfg)
    if auto:  # compiles auto's candidates (those `check_layout` passes): after all else
        _lay_out(cfg, devices)
    return corpus


def _bootstrap_fits(cfg: Config, unavailable: list[str] | None) -> None:
    """A teacher to bootstrap fits this host (`check_bootstrap_fits`); validate's
    `unavailable` collects it instead (`preflight`)."""
    if not uses_teacher(cfg):
        return
    try:
        check_bootstrap_fits(cfg)
    except DistillError as e:
        if unavailable is None:
            raise
        unavailable.append(str(e))


def _teacher_weights(cfg: Config, corpus: Corpus) -> None:
    if uses_teacher(cfg):
        check_teacher_weights(cfg, corpus)


def check_rows(cfg: Config, corpus: Corpus) -> None:
    """A training batch of distinct rows: a corpus with fewer train rows than
    `train.batch_size` is refused (its batches would repeat rows within a step)."""
    rows, bsz = corpus.train_rows, cfg.train.batch_size
    if getattr(corpus.train, "grouped", False):  # batches of one teacher's rows each
        for t, part in zip(cfg.teachers, corpus.train.parts, strict=True):
            if len(part) < bsz:
                raise DistillError(
                    f"data.teacher_batches: grouped, but teacher '{t.name}' has {len(part)} "
                    f"train rows, fewer than train.batch_size={bsz}; add its records or lower "
                    "the batch"
                )
    if rows < bsz:
        raise DistillError(
            f"data.source: {rows} train rows (of train.seq_len={cfg.train.seq_len} tokens, "
            f"after data.eval_fraction) are fewer than train.batch_size={bsz}; add data or "
            "lower train.batch_size"
        )


def preflight_role(cfg: Config, role: str) -> Corpus:
    """What `distill bench --role` needs: the config's shapes and the data; the role's mesh
    against the devices is checked as it is made (`distill.mesh.role_mesh`), the other
    role's not at all, and no weights or outputs are looked at. Returns the corpus."""
    devices = _devices(cfg)
    check_shapes(cfg)
    check_top_k(cfg)
    check_context(cfg)
    if role == "student":
        check_dense_output(cfg, devices[0])
    return _corpus(cfg)


def cross_tokenizer_corpus(cfg: Config) -> tuple[Corpus, Tokenizer]:
    """The student's rows with the teacher's own tokens of every row's text, aligned (each
    side renders chat and prompt/completion records with its own template); with the
    teacher's tokenizer. Local mode and every Ray actor read it so."""
    teacher = load_tokenizer(cfg.teacher.tokenizer, "teacher.tokenizer")
    seq, multiple = cfg.train.seq_len, row_multiple(cfg.mesh.teacher.cp, cfg.mesh.student.cp)
    if cfg.data.is_examples:
        return cross_example_corpus(cfg.data, seq, teacher, cfg.teacher, multiple), teacher
    return cross_corpus(cfg.data, seq, teacher, multiple=multiple), teacher


def _corpus(cfg: Config) -> Corpus:
    if cfg.cross_tokenizer():
        corpus, teacher = cross_tokenizer_corpus(cfg)
        if teacher.vocab_size > cfg.teacher.model.vocab_size:
            raise DistillError(
                f"teacher.model.vocab_size: {cfg.teacher.model.vocab_size} is smaller than the "
                f"tokenizer's vocabulary ({teacher.vocab_size}, "
                f"teacher.tokenizer={cfg.teacher.tokenizer})"
            )
        check_cross_top_k(cfg, teacher.vocab_size)
        check_dense_elements(cfg, getattr(corpus.train, "teacher_len", None))
    elif cfg.data.teacher_field is not None:  # each teacher's records packed apart
        corpus = routed_corpus(cfg.data, cfg.train.seq_len, [t.name for t in cfg.teachers])
    else:
        corpus = load_corpus(cfg.data, cfg.train.seq_len)
    for_each(cfg, lambda one: check_vocabularies(one, corpus.tokenizer.vocab_size))
    return corpus


def check_cross_top_k(cfg: Config, teacher_live: int) -> None:
    """Across tokenizers a top-k with a tail (k below the teacher tokenizer's `teacher_live`
    ids) keeps k below the student's vocabulary, so the student always has mass outside
    the top-k's buckets for the tail; a top-k of every teacher id has no tail."""
    k, vs = cfg.teacher.top_k, cfg.student_model().vocab_size
    if k is not None and vs <= k < teacher_live:
        raise DistillError(
            f"teacher.top_k: {k} must be below student.model.vocab_size ({vs}), or hold every "
            f"id of teacher.tokenizer ({teacher_live})"
        )


def check_vocabularies(cfg: Config, live: int) -> None:
    """Both models cover the tokenizer's `live` ids; their vocabularies may differ by padding
    (masked everywhere). With differing vocabularies a top-k teacher keeps k <= `live`, so
    that its ids are all live ones, which the student's vocabulary holds: a padded id is
    masked to -inf and never outranks a live one."""
    t, s = cfg.teacher.model, cfg.student_model()
    # with its own tokenizer (cross-tokenizer), the teacher's vocabulary is checked against it
    for role, m in (("teacher", t), ("student", s))[int(cfg.cross_tokenizer()) :]:
        if live > m.vocab_size:
            raise DistillError(
                f"{role}.model.vocab_size: {m.vocab_size} is smaller than the tokenizer's "
                f"vocabulary ({live}, data.tokenizer={cfg.data.tokenizer})"
            )
    k = cfg.teacher.top_k
    if t.vocab_size != s.vocab_size and k is not None and k > live and not cfg.cross_tokenizer():
        raise DistillError(
            f"teacher.top_k: {k} exceeds the tokenizer's {live} ids, and the teacher's and "
            f"student's vocabularies differ ({t.vocab_size} vs {s.vocab_size})"
        )
