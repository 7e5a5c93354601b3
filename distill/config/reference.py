"""The configuration reference, generated from the schema: `docs/reference/config.md`.

Every key path (``teacher.model.d_model``), its type, default and description, one table per
section in schema order. The schema's descriptions are the one source; the committed page is
regenerated with ``python -m distill.config.reference`` and a test fails when it is stale.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from distill.config.model import ModelConfig
from distill.config.schema import Config
from distill.config.student_model import StudentModelOverrides

OUTPUT = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"
COMMAND = "python -m distill.config.reference"

_HEADER = f"""# Configuration reference

<!-- Generated from the schema in distill/config/ by `{COMMAND}`; do not edit. -->

A pipeline is one YAML file whose sections are the headings below; `distill CMD CONFIG
--set key.path=value` overrides any key (YAML scalars, typed by the schema:
`--set train.steps=50 --set teacher.top_k=null`). Every section rejects unknown keys, and
every mistake is reported as one line naming its key, before any device work. The
student's `student.model.*` keys are overrides of `teacher.model.*`: unset keys inherit the
teacher's value. Shipped examples: {{shipped}}.
"""
PIPELINES = OUTPUT.parents[2] / "pipelines"


def _section(annotation) -> type[BaseModel] | None:
    """The config section class an annotation holds (``X`` or ``X | None``), if any."""
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _type(annotation) -> str:
    """A reader's spelling of a field's type: ``int``, ``list[str]``, ``'a', 'b'``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin in (tuple, list) and (len(args) == 1 or args[-1] is Ellipsis):
        inner = _type(args[0])  # YAML writes a tuple as a list
        return f"list of ({inner})" if " " in inner else f"list of {inner}"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type(a) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory else field.default
    return f"`{json.dumps(value)}`"  # as YAML reads it: null, false, "text"


def _description(cls: type[BaseModel], name: str, field) -> str:
    if field.description:
        return field.description
    if cls is StudentModelOverrides:
        return f"Overrides `teacher.model.{name}`: {ModelConfig.model_fields[name].description}"
    raise ValueError(f"{cls.__name__}.{name} has no description")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _tables(cls: type[BaseModel], path: str) -> list[str]:
    """The section at `path`: its own keys' table, then its nested sections, in order."""
    doc = cls.__dict__.get("__doc__")
    out = [f"## `{path}`", ""]
    if doc:
        out += [" ".join(doc.split()), ""]
    rows, nested = [], []
    for name, field in cls.model_fields.items():
        sub = _section(field.annotation)
        key = f"{path}.{name}"
        if sub is not None and sub.model_fields and field.annotation is sub:
            nested.append((sub, key))
            continue
        row = (f"`{key}`", _type(field.annotation), _default(field))
        rows.append((*row, _description(cls, name, field)))
        if sub is not None:  # an optional object (rope_scaling): its keys follow it
            for sub_name, sub_field in sub.model_fields.items():
                sub_row = (f"`{key}.{sub_name}`", _type(sub_field.annotation), _default(sub_field))
                rows.append((*sub_row, _description(sub, sub_name, sub_field)))
    if rows:
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
        out.append("")
    for sub, key in nested:
        out += _tables(sub, key)
    return out


def config_reference() -> str:
    """The Markdown of `docs/reference/config.md`, generated from `Config`."""
    shipped = ", ".join(f"`pipelines/{p.name}`" for p in sorted(PIPELINES.glob("*.yaml")))
    lines = [_HEADER.replace("{shipped}", shipped)]
    for name, field in Config.model_fields.items():
        lines += _tables(_section(field.annotation), name)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the reference to `docs/reference/config.md` (or the path given)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m distill.config.reference",
        description="Write the config reference, generated from the schema.",
    )
    parser.add_argument("path", nargs="?", default=str(OUTPUT), help=f"default: {OUTPUT}")
    path = Path(parser.parse_args(sys.argv[1:] if argv is None else argv).path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_reference())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
