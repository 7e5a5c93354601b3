"""Making a `Config`: read YAML, apply `--set key.path=value` overrides, validate, resolve.

The schema (`distill.config`) does no I/O; everything that touches the disk happens here,
once, at the door: the YAML file, `teacher.format: auto` resolved to `hf` or `distill`, and
a Hugging Face teacher's `teacher.model` read from its config.json. Every config a command
uses is made by `load_config` or `config_from_dict`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from distill.config import RUNTIME_KEYS, Config
from distill.config.teachers import resolve_teachers
from distill.errors import DistillError, error_lines
from distill.models import hf


def _parse_value(text: str) -> Any:
    """`--set` values are YAML scalars: 3, 1e-3, true, null, [1, 2], 'text'. A braced name
    alone (`{stdlib}`, `{stdlib_chat}`: YAML's one-key mapping {stdlib: null}) is the text
    itself, as data.source's placeholders are written."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    one_name = isinstance(value, dict) and len(value) == 1 and None in value.values()
    if one_name and text.strip() == "{" + str(next(iter(value))) + "}":
        return text.strip()
    return value


def apply_override(tree: dict, assignment: str) -> None:
    """Set `key.path=value` in a raw config tree, creating sections on the way."""
    if "=" not in assignment:
        raise DistillError(f"--set {assignment!r}: expected key.path=value")
    path, value = assignment.split("=", 1)
    keys = path.strip().split(".")
    node = tree
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise DistillError(f"--set {path}: {k} is not a section")
        node = nxt
    node[keys[-1]] = _parse_value(value)


def _read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if "://" in str(path):  # a run's config.yaml in a bucket (`distill export gs://...`)
        from etils import epath

        from distill import storage

        storage.check(str(path), "config")
        p = epath.Path(path)
    if not p.is_file():
        raise DistillError(f"config file not found: {p}")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise DistillError(f"{p}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise DistillError(f"{p}: the top level must be a mapping of sections")
    return tree


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML, apply `--set` overrides, validate and resolve.

    Raises DistillError; a schema with several mistakes gives one line per mistake."""
    tree = _read_yaml(path) if path is not None else {}
    for o in overrides:
        apply_override(tree, o)
    return config_from_dict(tree)


def config_from_dict(tree: dict) -> Config:
    """Validate a raw config tree and resolve what depends on the disk (the teacher's format
    and a Hugging Face teacher's model shape)."""
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise DistillError("\n".join(error_lines(e, model=Config))) from None
    resolve_teachers(cfg, _resolve_teacher)  # `teacher`, or each of `teachers` (the first is it)
    _resolve_student(cfg)
    if cfg.distill.moe_aux_loss and not cfg.student_model().n_experts:  # validates it too
        raise DistillError(
            f"distill.moe_aux_loss: {cfg.distill.moe_aux_loss} needs a mixture-of-experts "
            "student (student.model.n_experts is 0)"
        )
    if cfg.student.checkpoint is not None:
        if cfg.student.init_layers is not None:
            raise DistillError("student.init_layers: set, but student.checkpoint is set")
    elif cfg.student.init == "from_teacher":
        cfg.init_layers()
    elif cfg.student.init_layers is not None:
        raise DistillError(
            "student.init_layers: set, but student.init is random (not from_teacher)"
        )
    return cfg


def _resolve_teacher(cfg: Config) -> None:
    """`teacher.format: auto` -> hf when `teacher.checkpoint` is a local directory holding a
    config.json, else distill; a Hugging Face teacher's `teacher.model` from that file."""
    teacher = cfg.teacher
    ckpt = teacher.checkpoint
    # a teacher whose shape would come from its config.json (teacher.model unset): missing,
    # it is named as missing, not as a mismatch with the default shape (preflight refuses a
    # missing teacher of a shape given: `check_teacher_source`)
    from_file = teacher.format == "hf" or not teacher.model.model_fields_set
    weights = teacher.source == "online" or cfg.student.init == "from_teacher"
    made = teacher.format != "hf" and teacher.pretrain_steps > 0  # the bootstrap makes it
    local = bool(ckpt) and "://" not in ckpt
    if local and not Path(ckpt).exists() and from_file and weights and not made:
        raise DistillError(_missing("teacher.checkpoint", ckpt))
    if teacher.format == "auto":
        local_hf = bool(ckpt) and "://" not in ckpt and hf.config_file(ckpt).is_file()
        teacher.format = "hf" if local_hf else "distill"
    if teacher.format != "hf":
        return
    if not ckpt:
        raise DistillError("teacher.checkpoint: required when teacher.format is hf")
    if "://" in ckpt:
        raise DistillError(
            f"teacher.checkpoint: {ckpt}: a Hugging Face teacher is read "
            "from a local directory; copy it to local disk first"
        )
    _teacher_model_from_hf(cfg)


def _resolve_student(cfg: Config) -> None:
    """A pretrained student (`student.checkpoint`): its model from its config.json, keys set
    in `student.model` agreeing with it, and its tokenizer the run's."""
    ckpt = cfg.student.checkpoint
    if ckpt is None:
        return
    if "://" not in ckpt and not Path(ckpt).exists():
        raise DistillError(_missing("student.checkpoint", ckpt))
    if "://" in ckpt or not hf.config_file(ckpt).is_file():
        raise DistillError(
            f"student.checkpoint: {ckpt} is not a local Hugging Face directory with a config.json"
        )
    derived = hf.read_model_config(ckpt)
    given = cfg.student.model
    for key in sorted(given.model_fields_set - set(RUNTIME_KEYS)):
        value = getattr(given, key)
        if value is not None and value != getattr(derived, key):
            raise DistillError(
                f"student.model.{key}: {value} differs from {getattr(derived, key)} in "
                f"{hf.config_file(ckpt)}; a pretrained student's shape comes from its "
                "config.json: leave student.model unset"
            )
    _check_student_tokenizer(cfg)
    cfg.student._pretrained = derived


def _missing(key: str, path: str) -> str:
    return (
        f"{key}: {path} is missing (no such file or directory); download the model there, "
        f"or point {key} at it"
    )


def _check_student_tokenizer(cfg: Config) -> None:
    """The student's own tokenizer.json, when its directory has one, must be the run's
    (`data.tokenizer`): distillation here compares the two models id by id."""
    own = Path(cfg.student.checkpoint) / "tokenizer.json"
    if not own.is_file():
        return
    run = Path(cfg.data.tokenizer).expanduser() if cfg.data.tokenizer != "bytes" else None
    if run is not None and run.is_dir():
        run = run / "tokenizer.json"
    if run is None or not run.is_file() or _vocabulary(run) != _vocabulary(own):
        raise DistillError(
            f"student.checkpoint: {own} is not the run's tokenizer (data.tokenizer="
            f"{cfg.data.tokenizer}); teacher and student must share one tokenizer here "
            "(distilling across tokenizers is cross-tokenizer distillation, not supported by "
            "this mode)"
        )


def _vocabulary(path: Path) -> object:
    """What makes a tokenizer.json's ids: its model (vocabulary, merges) and added tokens;
    None for a file that is not one (a SentencePiece model)."""
    import json

    try:
        tree = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    added = [(t.get("id"), t.get("content")) for t in tree.get("added_tokens") or []]
    return tree.get("model"), added


def _teacher_model_from_hf(cfg: Config) -> None:
    """Set `teacher.model` from a Hugging Face config.json; keys set by hand must agree."""
    derived = hf.read_model_config(cfg.teacher.checkpoint)
    given = cfg.teacher.model
    derived = derived.model_copy(update={k: getattr(given, k) for k in RUNTIME_KEYS})
    for key in sorted(given.model_fields_set - set(RUNTIME_KEYS)):
        if getattr(given, key) != getattr(derived, key):
            raise DistillError(
                f"teacher.model.{key}: {getattr(given, key)} differs from "
                f"{getattr(derived, key)} in {hf.config_file(cfg.teacher.checkpoint)}; a Hugging "
                "Face teacher's shape comes from its config.json: leave teacher.model unset"
            )
    cfg.teacher.model = derived
