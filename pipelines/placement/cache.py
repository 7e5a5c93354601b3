"""Role costs kept on disk, so `mesh.placement: auto` compiles its candidates once per
config, device set and code rather than at every `validate`, `plan` and `run`, and finds
the role times `distill bench --placement` measured on this host.

Compiling every candidate role layout costs seconds to minutes (14 small programs for the
quick start on 8 simulated CPU devices). The costs are a pure function of the config's
shapes, the devices and the code that builds the programs, so they are cached under
`$DISTILL_CACHE_DIR` (default `$XDG_CACHE_HOME/distill`, i.e. `~/.cache/distill`), keyed by
a digest of all three: a changed config, device kind, jax or distill source is a miss. The
config's mesh layout (`mesh.placement` and both roles' axes) is not part of the key: every
candidate is costed whatever the config gives, so `bench --placement` on a split config
serves `auto` on the same config. Two kinds of entry share a key: `compiled` (predicted
from the compiled programs) and `measured` (timed by `distill bench --placement`). An
unreadable or unwritable cache is ignored (the costs are compiled again).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from distill.config import Config
from distill.observability.metrics_log import dumps
from distill.storage import cache_dir
from pipelines.placement.choice import RoleCost

log = logging.getLogger("distill")

# Sections that do not change a program's shapes or cost.
_IGNORED = {"run", "server", "wandb", "ray"}
_PACKAGES = ("distill", "teacher", "student", "pipelines")


def _code_digest() -> str:
    """A digest of distill's Python sources: the programs the costs were compiled from."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def key(cfg: Config, devices: list) -> str:
    """The digest of what the costs depend on: the config's shapes, the devices, the code."""
    import jax

    config = cfg.model_dump(mode="json", exclude=_IGNORED)
    for layout in ("placement", "teacher", "student"):  # every candidate is costed
        config["mesh"].pop(layout)
    t, s = cfg.mesh.teacher, cfg.mesh.student  # the axes auto keeps: in every program
    config["mesh"]["kept"] = [t.pp, t.cp, s.cp]
    what = {
        "config": config,
        "devices": [len(devices), devices[0].platform, devices[0].device_kind],
        "jax": jax.__version__,
        "code": _code_digest(),
    }
    return hashlib.sha256(dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def _path(cfg: Config, devices: list, kind: str) -> Path:
    suffix = "" if kind == "compiled" else f".{kind}"
    return cache_dir() / "placement" / f"{key(cfg, devices)}{suffix}.json"


def stored_costs(cfg: Config, devices: list, kind: str = "compiled") -> dict | None:
    """The costs of `kind` (compiled | measured) stored for this key, or None."""
    try:
        rows = json.loads(_path(cfg, devices, kind).read_text())
        return {(r["role"], tuple(r["shape"])): RoleCost(**r["cost"]) for r in rows}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_costs(cfg: Config, devices: list, costs: dict, kind: str = "compiled") -> None:
    """Keep `costs` ({(role, shape): RoleCost}) as this key's entry of `kind`."""
    path = _path(cfg, devices, kind)
    rows = [
        {"role": role, "shape": list(shape), "cost": dataclasses.asdict(cost)}
        for (role, shape), cost in costs.items()
    ]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(dumps(rows))
        tmp.replace(path)
    except OSError as e:
        log.warning("mesh.placement auto: the %s costs were not cached (%s)", kind, e)


def cached_costs(
    cfg: Config, devices: list, compute: Callable[[], dict], needed: list | None = None
) -> dict:
    """`compute()` ({(role, shape): RoleCost}), or the costs it gave before for the same key
    when they hold every (role, shape) of `needed` (the axes a config writes narrow auto's
    candidates, so an entry may hold fewer role layouts than another config of the same
    key needs: the new ones join it)."""
    costs = stored_costs(cfg, devices)
    if costs is None or any(k not in costs for k in needed or ()):
        costs = {**(costs or {}), **compute()}
        store_costs(cfg, devices, costs)
    return costs
