"""The one error type for mistakes a user can make (config, data, devices).

The CLI prints it as a single line and exits with status 2; it is never shown as a
traceback. Raise it before any device work starts, naming the field or file at fault.
A run that fails once started (a diverged run) is a `RunFailed`: one line, status 3.
"""

from pydantic import ValidationError


class DistillError(Exception):
    """A user-facing error: bad config, bad data, or devices that do not fit."""


class RunFailed(Exception):
    """A run that started and had to stop: its training diverged. The CLI prints the one
    line and exits with status `RUN_FAILED`, after the run's outputs say the same."""


RUN_FAILED = 3  # the CLI's exit status for RunFailed (2 is a DistillError)


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
