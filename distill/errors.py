"""The one error type for mistakes a user can make (config, data, devices).

The CLI prints it as a single line and exits with status 2; it is never shown as a
traceback. Raise it before any device work starts, naming the field or file at fault.
"""

from pydantic import ValidationError


class DistillError(Exception):
    """A user-facing error: bad config, bad data, or devices that do not fit."""


def error_lines(err: ValidationError, prefix: str = "") -> list[str]:
    """One `config: key.path: message` line per validation error, in the schema's order."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
        path = ".".join(p for p in (prefix, loc) if p)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required field is missing"
        line = f"config: {path}: {msg}" if path else f"config: {msg}"
        if line not in lines:
            lines.append(line)
    return lines
