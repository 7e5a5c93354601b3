"""The layout of `run.output_dir`: config.yaml, metrics.jsonl, checkpoints/, summary.json, and
the default place of a bootstrapped teacher."""

from __future__ import annotations

from etils import epath

from distill.config import Config
from distill.observability.metrics_log import dumps


def out_dir(cfg: Config) -> epath.Path:
    return epath.Path(cfg.run.output_dir)


def teacher_path(cfg: Config) -> str:
    """The teacher's weights: `teacher.checkpoint`, default the bootstrap's <output_dir>/teacher."""
    return cfg.teacher.checkpoint or f"{cfg.run.output_dir.rstrip('/')}/teacher"


def checkpoint_dir(cfg: Config) -> str:
    return str(out_dir(cfg) / "checkpoints")


def write_config(cfg: Config) -> None:
    out_dir(cfg).mkdir(parents=True, exist_ok=True)
    (out_dir(cfg) / "config.yaml").write_text(cfg.to_yaml())


def write_summary(cfg: Config, summary: dict) -> None:
    (out_dir(cfg) / "summary.json").write_text(dumps(summary, indent=2) + "\n")
