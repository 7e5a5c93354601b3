"""The one error type for mistakes a user can make (config, data, devices).

The CLI prints it as a single line and exits with status 2; it is never shown as a
traceback. Raise it before any device work starts, naming the field or file at fault.
A run that fails once started (a diverged run) is a `RunFailed`: one line, status 3.
"""

import difflib
import typing

from pydantic import BaseModel, ValidationError


class DistillError(Exception):
    """A user-facing error: bad config, bad data, or devices that do not fit."""


class RunFailed(Exception):
    """A run that started and had to stop: its training diverged. The CLI prints the one
    line and exits with status `RUN_FAILED`, after the run's outputs say the same."""


RUN_FAILED = 3  # the CLI's exit status for RunFailed (2 is a DistillError)


def error_lines(
    err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None
) -> list[str]:
    """One `config: key.path: message` line per validation error, in the schema's order;
    with the `model` validated, an unknown key or a value outside a field's choices ends in
    the nearest valid one ("did you mean train.steps?")."""
    lines = []
    for e in err.errors():
        parts = [str(p) for p in e["loc"] if not str(p).startswith("function-after")]
        path = ".".join(p for p in (prefix, ".".join(parts)) if p)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            section = _section(model, parts[:-1])
            names = list(section.model_fields) if section is not None else []
            near = difflib.get_close_matches(parts[-1], names, n=1)
            key = ".".join(p for p in (prefix, *parts[:-1], *near[:1]) if p)
            msg = "unknown key" + (f"; did you mean {key}?" if near else "")
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] == "literal_error" and parts:
            section = _section(model, parts[:-1])
            field = section.model_fields.get(parts[-1]) if section is not None else None
            choices = [str(c) for c in _literals(field.annotation)] if field else []
            near = difflib.get_close_matches(str(e["input"]), choices, n=1)
            msg += f"; did you mean {near[0]}?" if near else ""
        line = f"config: {path}: {msg}" if path else f"config: {msg}"
        if line not in lines:
            lines.append(line)
    return lines


def _section(model: type[BaseModel] | None, parts: list[str]) -> type[BaseModel] | None:
    """The config section (model class) at `parts` below `model`, or None."""
    for part in parts:
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        model = _model_of(field.annotation)
    return model


def _model_of(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):  # Optional[Section], Section | None
        if (found := _model_of(arg)) is not None:
            return found
    return None


def _literals(annotation) -> list:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return [v for arg in typing.get_args(annotation) for v in _literals(arg)]
