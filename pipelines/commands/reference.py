"""The CLI reference, generated from the argument parser: `docs/reference/cli.md`.

Each command's `distill CMD --help`, at a fixed width so the page does not depend on the
terminal. Regenerate with ``python -m pipelines.commands.reference``; a test fails when the
committed page differs from a fresh generation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.commands.cli import _parser

OUTPUT = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"
COMMAND = "python -m pipelines.commands.reference"
WIDTH = 100

_HEADER = f"""# CLI reference

<!-- Generated from pipelines/commands/cli.py by `{COMMAND}`; do not edit. -->

Every command that takes a `CONFIG` also takes `--set key.path=value` (repeatable) to
override any key of the [configuration](config.md). A mistake a user can make (a config
key, a data file, a device count, a checkpoint) is printed as one line,
`distill: error: ...`, with exit status 2, before any device work. A run that fails once
started (it [diverged](outputs.md#a-run-that-diverges)) prints one such line with exit
status 3. The guides show what each command is for: [docs/README.md](../README.md).
"""


def _help(parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
    return parser.format_help().rstrip()


def cli_reference() -> str:
    """The Markdown of `docs/reference/cli.md`: `distill --help`, then each command's."""
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {a.dest: a.help for a in sub._choices_actions}
    out = [_HEADER, "| command | what it does |", "|---|---|"]
    out += [f"| [`distill {name}`](#distill-{name}) | {summaries[name]} |" for name in sub.choices]
    out += ["", "## `distill`", "", "```text", _help(parser), "```", ""]
    for name, command in sub.choices.items():
        out += [f"## `distill {name}`", "", "```text", _help(command), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the reference to `docs/reference/cli.md` (or the path given)."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else OUTPUT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cli_reference())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
