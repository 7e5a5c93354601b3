"""Orbax checkpoints: the student's whole training state with the data iterator state.

One checkpoint step holds `state` (params, optimizer state, step) and `data` (the Grain
iterator state as JSON) together, written asynchronously and atomically by Orbax's
CheckpointManager, keeping the last N. Restoring takes a target with shardings, so a
checkpoint written on one `dp` restores onto another; a resume takes the newest checkpoint
that restores and sets unreadable newer ones aside. Teacher weights are a plain Orbax
pytree of parameters, restored straight into the tensor-parallel layout.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from distill.errors import DistillError

log = logging.getLogger("distill")

UNREADABLE = ".unreadable-"  # `<step>.unreadable-<n>`: a step dir set aside by `restore`


def _path(path: str) -> epath.Path:
    """Local paths become absolute (Orbax needs that); gs:// and other URIs pass through."""
    return epath.Path(path if "://" in path else os.path.abspath(path))


def _reason(e: BaseException, limit: int = 300) -> str:
    """The first line of the innermost error, without the TensorStore spec that Orbax and
    TensorStore put around `DATA_LOSS: ...`-style messages."""
    while e.__cause__ is not None:
        e = e.__cause__
    line = (str(e).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0]
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return f"{type(e).__name__}: {line}"


def _quiet_abandoned_reads() -> None:
    """A failed Orbax restore leaves its other reads in flight: TensorStore's callbacks
    later find the restore's event loop closed, its coroutines are closed by the collector,
    its tasks' errors are never retrieved. Python and asyncio report each with a traceback,
    hundreds of lines for one bad checkpoint, whenever they come. From the first restore
    on, those reports are dropped; any other is passed on."""
    previous = sys.unraisablehook
    if not getattr(previous, "quiets_abandoned_reads", False):

        def hook(unraisable) -> None:
            exc, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
            loop_closed = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
            if not (loop_closed or "orbax" in getattr(code, "co_filename", "")):
                previous(unraisable)

        hook.quiets_abandoned_reads = True
        sys.unraisablehook = hook
    asyncio_log = logging.getLogger("asyncio")
    if _not_abandoned not in asyncio_log.filters:
        asyncio_log.addFilter(_not_abandoned)


def _not_abandoned(record: logging.LogRecord) -> bool:
    text = record.getMessage()
    unretrieved = text.startswith(("Task exception was never", "Future exception was never"))
    return not (unretrieved and ("orbax" in text or "tensorstore_spec" in text))


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    """Whether every floating-point value of `tree` is finite: one boolean scalar, computed
    where the arrays are."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves] or [jnp.bool_(True)]))


class Checkpointer:
    def __init__(
        self, directory: str, keep: int = 3, async_save: bool = True, meta: dict | None = None
    ):
        """`meta` (JSON; e.g. `distill.identity.run_identity`) is saved with every step."""
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self._mngr = ocp.CheckpointManager(_path(directory), options=options)
        self.meta = meta

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(
        self,
        step: int,
        state: Any,
        data_state: dict,
        *,
        force: bool = False,
        extra: Any = None,
        notes: dict | None = None,
    ) -> bool:
        """`extra`: a pytree saved beside the state (e.g. the recent parameters an
        on-policy run generates with), read back by `restore_extra`; `notes`: JSON of the
        run's own state beside it (the `distill.alpha` in effect), read back by
        `stored_notes`. A state holding a
        non-finite value is not written (False, with a warning): the newest checkpoint is
        then always a finite one, and retention (`keep`) only ever deletes older ones."""
        if not bool(_all_finite(state)):  # one scalar: the save waits for the state anyway
            log.warning("checkpoint step %d not written: the state holds non-finite values", step)
            return False
        items = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(data_state)}
        if self.meta is not None:
            items["meta"] = ocp.args.JsonSave(self.meta)
        if extra is not None:
            items["extra"] = ocp.args.StandardSave(extra)
        if notes is not None:
            items["notes"] = ocp.args.JsonSave(notes)
        return self._mngr.save(step, args=ocp.args.Composite(**items), force=force)

    def restore_extra(self, step: int, abstract_extra: Any) -> Any:
        """The `extra` saved with `step`, onto the shardings of `abstract_extra`."""
        args = ocp.args.Composite(extra=ocp.args.StandardRestore(abstract_extra))
        try:
            return self._mngr.restore(step, args=args).extra
        except (KeyError, FileNotFoundError, ValueError) as e:
            raise DistillError(
                f"run.output_dir: checkpoint step {step} lacks what this run needs to resume "
                f"exactly (the recent parameters of an on-policy run): {_reason(e)}"
            ) from None

    def stored_meta(self, step: int | None = None) -> dict | None:
        """The `meta` saved with `step` (default the latest); None when there is none (no
        checkpoint, one written before `meta` existed, or one whose `meta` is unreadable)."""
        return self._stored_json("meta", step)

    def stored_notes(self, step: int | None = None) -> dict | None:
        """The `notes` saved with `step` (default the latest), or None, as `stored_meta`."""
        return self._stored_json("notes", step)

    def _stored_json(self, item: str, step: int | None) -> dict | None:
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        try:
            args = ocp.args.Composite(**{item: ocp.args.JsonRestore()})
            return getattr(self._mngr.restore(step, args=args), item)
        except (KeyError, FileNotFoundError, ValueError):
            return None

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """Restore (state, data_state, step); `abstract_state` carries target shardings.

        With `step=None`, the newest checkpoint that restores. A newer one that cannot be
        read (bit rot, a partial copy, a truncated file) is skipped with one warning and
        moved aside (`_set_aside`): the result is as if it had never been written. Only a
        checkpoint that fails while an older one restores is moved; when none restores
        (nor fits the target, e.g. a changed model), nothing moves: a DistillError."""
        if step is not None:
            return self._restore(abstract_state, step)
        self._mngr.wait_until_finished()  # a step still being written is not unreadable
        steps = sorted(self._mngr.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint to restore in {self._mngr.directory}")
        failed = []
        for step in steps:
            try:
                restored = self._restore(abstract_state, step)
            except DistillError:
                raise
            except Exception as e:  # what "unreadable" looks like is Orbax's and TensorStore's
                failed.append((step, _reason(e)))
                continue
            self._set_aside(failed, step)
            return restored
        listed = ", ".join(str(s) for s, _ in failed)
        raise DistillError(
            f"run.output_dir: no checkpoint in {self._mngr.directory} can be restored "
            f"(steps {listed}); step {failed[0][0]}: {failed[0][1]}"
        )

    def _restore(self, abstract_state: Any, step: int) -> tuple[Any, dict, int]:
        _quiet_abandoned_reads()
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
        )
        out = self._mngr.restore(step, args=args)
        return out.state, out.data, step

    def _set_aside(self, failed: list[tuple[int, str]], restored: int) -> None:
        """Rename each unreadable step dir to `<step>.unreadable-<n>`: nothing written is
        lost, and Orbax neither lists such a name (its steps match `^\\d+$`, its temporary
        dirs `.orbax-checkpoint-tmp`) nor counts it for `max_to_keep` nor deletes it, so
        the resumed run saves that step again. On gs:// the rename is a copy and delete."""
        root = self._mngr.directory
        for step, why in failed:
            src, n = root / str(step), 1
            while (root / f"{step}{UNREADABLE}{n}").exists():
                n += 1
            dst = root / f"{step}{UNREADABLE}{n}"
            if ocp.multihost.is_primary_host(0):
                try:
                    src.rename(dst)
                except Exception as e:
                    raise DistillError(
                        f"run.output_dir: checkpoint {src} cannot be read ({why}) nor moved "
                        f"aside to {dst} ({_reason(e)}); move or delete it and rerun"
                    ) from e
            log.warning(
                "checkpoint step %d cannot be read, using step %d; moved it aside to %s: %s",
                step,
                restored,
                dst,
                why,
            )
        if failed:
            ocp.multihost.sync_global_processes("distill_checkpoint_set_aside")
            self._mngr.reload()

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def read_meta(directory: str) -> dict | None:
    """`Checkpointer.stored_meta` of the latest checkpoint in `directory`; writes nothing."""
    if not has_checkpoint(directory):
        return None
    ckpt = Checkpointer(directory, async_save=False)
    try:
        return ckpt.stored_meta()
    finally:
        ckpt.close()


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


def load_param_part(path: str, abstract_part: Any) -> Any:
    """Read only the leaves of `abstract_part`, a subtree of the stored parameter pytree (the
    same keys, fewer of them), into its shardings and dtypes: one tensor at a time, so the
    host never holds the whole tree."""
    args = ocp.args.PyTreeRestore(
        item=abstract_part,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_part),
        partial_restore=True,
    )
    with ocp.PyTreeCheckpointer() as ckpt:
        return ckpt.restore(_path(path), args=args)


def params_exist(path: str | None) -> bool:
    return bool(path) and _path(path).exists() and any(_path(path).iterdir())


def abstract_like(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
