"""Orbax checkpoints: the student's whole training state with the data iterator state.

One checkpoint step holds `state` (params, optimizer state, step) and `data` (the Grain
iterator state as JSON) together, written asynchronously and atomically by Orbax's
CheckpointManager, keeping the last N. Restoring takes a target with shardings, so a
checkpoint written on one `dp` restores onto another. Teacher weights are a plain Orbax
pytree of parameters, restored straight into the tensor-parallel layout.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


def _path(path: str) -> epath.Path:
    """Local paths become absolute (Orbax needs that); gs:// and other URIs pass through."""
    return epath.Path(path if "://" in path else os.path.abspath(path))


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self._mngr = ocp.CheckpointManager(_path(directory), options=options)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
        )
        return self._mngr.save(step, args=args, force=force)

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """Restore (state, data_state, step); `abstract_state` carries target shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError("no checkpoint to restore")
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
        )
        out = self._mngr.restore(step, args=args)
        return out.state, out.data, step

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def has_checkpoint(directory: str) -> bool:
    path = _path(directory)
    return path.exists() and any(p.name.isdigit() for p in path.iterdir())


def save_params(path: str, params: Any) -> None:
    """Write a parameter pytree (the teacher's weights) synchronously."""
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(_path(path), params, force=True)


def load_params(path: str, abstract_params: Any) -> Any:
    """Read a parameter pytree; each device reads only its shard of the target sharding."""
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(_path(path), abstract_params)


def params_exist(path: str | None) -> bool:
    return bool(path) and _path(path).exists() and any(_path(path).iterdir())


def abstract_like(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
