"""Moving batch-major arrays from one mesh to the other, device to device.

`jax.device_put` of an array onto another mesh copies buffer to buffer only when each
destination shard is exactly one source shard (the same rows); for any other pair of
layouts it fetches the whole array to the host and places it again (JAX's slow path). The
teacher's outputs are batch-major, whole rows split over its devices (`teacher.sharding`),
and the student's batch sharding splits rows too, so `hop` never needs the host: when the
row blocks match it is that plain copy; when they do not (a teacher split over more devices
than the student, or fewer), each student shard is made on its device from copies of the
teacher's row blocks it spans, sliced on the teacher's devices where a block reaches past it.
Colocated meshes (`mesh.placement: colocated`) share devices: where a device's own teacher
block is exactly its student rows the buffer is handed over as it is (no copy), and where it
covers them the rows are sliced on that device. A student that splits each row's positions
too (`mesh.student.cp`) gets its shards the same way, each part cut to the shard's
positions on the teacher's device before it moves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Rows = tuple[int, int]  # [start, stop) of the leading axis


def hop(tree, sharding):
    """Each array of `tree` placed on `sharding` (host arrays: one host-to-device put)."""
    return jax.tree.map(lambda x: _hop(x, sharding), tree)


def row_blocks(index: tuple, shape: tuple[int, ...]) -> Rows | None:
    """The rows a shard's index covers, or None if it splits any axis but the first."""
    if any(s.indices(n)[:2] != (0, n) for s, n in zip(index[1:], shape[1:], strict=True)):
        return None
    return index[0].indices(shape[0])[:2]


def _hop(x, sharding):
    if not isinstance(x, jax.Array) or x.sharding == sharding:
        return jax.device_put(x, sharding)
    src: dict[Rows, jax.Array] = {}
    local: dict[tuple[Rows, object], jax.Array] = {}  # (rows, device): that device's block
    for shard in x.addressable_shards:
        rows = row_blocks(shard.index, x.shape)
        if rows is None:  # not batch-major: JAX's own reshard (may go through the host)
            return jax.device_put(x, sharding)
        src.setdefault(rows, shard.data)
        local[rows, shard.device] = shard.data
    indices = sharding.addressable_devices_indices_map(x.shape)
    dst = {device: row_blocks(index, x.shape) for device, index in indices.items()}
    if None in dst.values():
        return _to_pieces(x, sharding, src, local, indices)
    if all((rows, device) in local for device, rows in dst.items()):
        # colocated meshes whose row blocks agree: each device keeps its buffer, no copy
        shards = [local[rows, device] for device, rows in dst.items()]
        return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)
    if all(rows in src for rows in dst.values()):
        return jax.device_put(x, sharding)  # one buffer copy per destination device
    shards = [_assemble(src, local, rows, device) for device, rows in dst.items()]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def _to_pieces(x, sharding, src: dict[Rows, jax.Array], local: dict, indices: dict):
    """`x` onto a `sharding` that also splits its second (sequence) axis (the student's
    context parallelism, `student.sharding.batch_spec`): each destination shard assembled
    from the source's row blocks as `_assemble` does, each part cut to the shard's
    positions on its source device before it moves, so no device receives more than its
    share. JAX's own reshard where the destination splits any later axis."""
    shards = []
    for device, index in indices.items():
        if row_blocks((index[0], slice(None), *index[2:]), x.shape) is None:
            return jax.device_put(x, sharding)
        rows, cols = (index[a].indices(x.shape[a])[:2] for a in (0, 1))
        shards.append(_assemble(src, local, rows, device, cols))
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def _assemble(
    src: dict[Rows, jax.Array], local: dict, rows: Rows, device, cols: Rows | None = None
) -> jax.Array:
    """Rows [a, b) on `device` (and of them the positions `cols`, [c, d) of the second
    axis, when given): from a block the device holds itself where one covers them
    (colocated meshes: sliced there, nothing crosses devices), else the overlapping part of
    each source block (sliced on its own device), copied over, concatenated there."""
    a, b = rows

    def positions(part):
        return part if cols is None else jax.lax.slice_in_dim(part, *cols, axis=1)

    for (s0, s1), dev in local:
        if dev == device and s0 <= a and b <= s1:
            return positions(jax.lax.slice_in_dim(local[(s0, s1), dev], a - s0, b - s0))
    parts = []
    for (s0, s1), buf in sorted(src.items()):
        lo, hi = max(a, s0), min(b, s1)
        if lo < hi:
            part = buf if (lo, hi) == (s0, s1) else jax.lax.slice_in_dim(buf, lo - s0, hi - s0)
            parts.append(jax.device_put(positions(part), device))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
