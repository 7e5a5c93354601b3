"""Print the pip requirements of the container image, one per line, from pyproject.toml.

The Dockerfile installs these in their own layer, before the source is copied, so a code
change does not reinstall the dependencies. Only the standard library is used: this runs
in the bare build venv.

    python3 image_requirements.py [--pyproject FILE] [--accelerator cpu|cuda12|cuda13|tpu]
                                  [--extras "ray gcs"]

``--accelerator`` adds the matching JAX extra to the ``jax`` requirement (``cpu``: plain
``jax``); ``--extras`` adds the named ``[project.optional-dependencies]`` groups.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ACCELERATORS = {"cpu": None, "cuda12": "cuda12", "cuda13": "cuda13", "tpu": "tpu"}
_REQ = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[(?P<extras>[^\]]*)\])?(?P<rest>.*)$"
)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def with_jax_extra(requirement: str, extra: str | None) -> str:
    """`jax>=0.8` -> `jax[cuda12]>=0.8`; other requirements pass through unchanged."""
    m = _REQ.match(requirement)
    if extra is None or m is None or _canonical(m["name"]) != "jax":
        return requirement
    extras = [e.strip() for e in (m["extras"] or "").split(",") if e.strip()]
    if extra not in extras:
        extras.append(extra)
    return f"{m['name']}[{','.join(extras)}]{m['rest']}"


def requirements(project: dict, accelerator: str = "cpu", extras: list[str] = ()) -> list[str]:
    """The image's requirements: project dependencies (+ JAX accelerator extra) + extras."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"ACCELERATOR={accelerator!r}: expected one of {', '.join(ACCELERATORS)}")
    deps = list(project.get("dependencies", []))
    if not any(_canonical(_REQ.match(d)["name"]) == "jax" for d in deps if _REQ.match(d)):
        raise ValueError("pyproject.toml: [project] dependencies name no jax requirement")
    optional = project.get("optional-dependencies", {})
    for name in extras:
        if name not in optional:
            known = ", ".join(sorted(optional)) or "none"
            raise ValueError(f"EXTRAS: {name!r} is not an optional-dependencies group ({known})")
        deps += optional[name]
    extra = ACCELERATORS[accelerator]
    return [with_jax_extra(d, extra) for d in deps]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", default="pyproject.toml")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--extras", default="", help="space- or comma-separated group names")
    args = parser.parse_args(argv)
    project = tomllib.loads(Path(args.pyproject).read_text())["project"]
    try:
        reqs = requirements(project, args.accelerator, args.extras.replace(",", " ").split())
    except ValueError as e:
        print(f"image_requirements: {e}", file=sys.stderr)
        return 2
    print("\n".join(reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
