"""What a distill teacher checkpoint says about itself: how it was made, and its shapes.

A teacher bootstrapped by distill (`pipelines.bootstrap`) carries `distill_provenance.json`
inside its checkpoint directory: every setting that made it, keyed by the config key that
sets it (`teacher.model.*`, `teacher.pretrain_steps`, `teacher.pretrain_lr`, the `optim.*`
settings it trained with, `train.seq_len`, `train.batch_size`, `run.seed`,
`teacher.dtype`, the tokenizer's identity under `data.tokenizer`, the `data.*` settings that
shape the rows, and `data`: the hash of the packed token streams, as the teacher cache
records it). A run whose config would make another teacher is refused in one line naming
the first differing key (`check`); a checkpoint without the record (a user's own) is used
as it is. `check_shapes` compares the stored array shapes (Orbax metadata, no weights read)
with `teacher.model`.
"""

from __future__ import annotations

import datetime
import json
import os

import jax
import orbax.checkpoint as ocp
from etils import epath

from distill.config import RUNTIME_KEYS, Config
from distill.data.prepared import data_settings
from distill.errors import DistillError
from distill.models import model
from distill.observability.metrics_log import dumps

FILE = "distill_provenance.json"
KIND = "distill teacher bootstrap"
FORMAT = 1


def record(cfg: Config, data_hash: str, tokenizer: dict) -> dict:
    """The provenance record of the teacher that `cfg`'s bootstrap makes from the data whose
    hash is `data_hash` (`distill.identity.data_hash`), tokenised by `tokenizer`
    (`distill.data.prepared.tokenizer_identity`)."""
    t = cfg.teacher
    optim = cfg.optim.model_dump(mode="json")
    settings = {
        **{
            f"teacher.model.{k}": v
            for k, v in t.model.model_dump(mode="json").items()
            if k not in RUNTIME_KEYS
        },
        "teacher.pretrain_steps": t.pretrain_steps,
        "teacher.pretrain_lr": t.pretrain_lr,
        **{f"optim.{k}": v for k, v in optim.items() if k != "lr"},  # lr: pretrain_lr
        "train.seq_len": cfg.train.seq_len,
        "train.batch_size": cfg.train.batch_size,
        "run.seed": cfg.run.seed,
        "teacher.dtype": t.dtype,
        "data.tokenizer": tokenizer,
        **{f"data.{k}": v for k, v in data_settings(cfg.data).items()},
        "data": data_hash,
    }
    return {"kind": KIND, "format": FORMAT, "settings": settings}


def read(path: str) -> dict | None:
    """The record in the checkpoint directory `path`; None when there is none."""
    f = epath.Path(path) / FILE
    if not f.exists():
        return None
    try:
        rec = json.loads(f.read_text())
    except ValueError:
        raise DistillError(f"teacher.checkpoint: {f} is not valid JSON") from None
    return rec if isinstance(rec, dict) and rec.get("kind") == KIND else None


def write(path: str, rec: dict) -> None:
    """Write `rec` (with the time) into the checkpoint directory `path`, replacing any."""
    stamped = {**rec, "created": datetime.datetime.now(datetime.UTC).isoformat()}
    (epath.Path(path) / FILE).write_text(dumps(stamped, indent=1) + "\n")


def _show(value) -> str:
    if isinstance(value, dict):  # a tokenizer identity
        return str(value.get("sha256") or value.get("kind"))[:12]
    if isinstance(value, str) and value.startswith("sha256:"):
        return value[:19]
    return dumps(value)


def check(stored: dict, expected: dict, path: str) -> None:
    """One-line DistillError naming the first config key whose value differs from the one
    the teacher at `path` was bootstrapped with. The data counts as differing only when its
    hash does (the rows may be read from elsewhere); the message then names the first
    differing `data.*` setting, else `data`."""
    was, now = stored.get("settings", {}), expected["settings"]
    for key, value in now.items():
        if key not in was or (key.startswith("data.") and key != "data.tokenizer"):
            continue
        if was[key] == value:
            continue
        if key == "data":
            key, value = next(
                ((k, v) for k, v in now.items() if k.startswith("data.") and was.get(k, v) != v),
                (key, value),
            )
        raise DistillError(
            f"{key}: {_show(value)} differs from {_show(was[key])}, with which the teacher at "
            f"{path} was bootstrapped; set it back to use that teacher as made, "
            "teacher.rebootstrap=true to bootstrap it again (replacing it), or "
            "teacher.pretrain_steps=0 to use it as it is"
        )


def _flat(tree) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        ".".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
        for path, leaf in leaves
    }


def check_shapes(cfg: Config, path: str) -> None:
    """One-line DistillError naming `teacher.checkpoint` when the arrays stored at `path`
    (read from Orbax's metadata: no weights are loaded) are not `teacher.model`'s."""
    with ocp.StandardCheckpointer() as ckpt:
        meta = ckpt.metadata(path if "://" in path else os.path.abspath(path)).item_metadata
    if meta is None:
        raise DistillError(
            f"teacher.checkpoint: {path} holds neither a Hugging Face checkpoint (config.json "
            "and safetensors weights) nor a distill (Orbax) checkpoint; download the "
            "teacher's weights there, or point teacher.checkpoint at an empty directory "
            "to bootstrap one (teacher.pretrain_steps)"
        )
    stored = _flat(getattr(meta, "tree", meta))
    wanted = _flat(model.abstract_params(cfg.teacher.model))
    for name in sorted(stored.keys() | wanted.keys()):
        have, want = stored.get(name), wanted.get(name)
        if have == want:
            continue
        have_s = f"stored {list(have)}" if have is not None else "not stored"
        want_s = f"gives {list(want)}" if want is not None else "has no such array"
        raise DistillError(
            f"teacher.checkpoint: {path}: {name}: {have_s}, teacher.model {want_s}; set "
            "teacher.model to the checkpoint's shape, or point teacher.checkpoint at a "
            "teacher of this one"
        )
