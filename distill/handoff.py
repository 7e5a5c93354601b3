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
covers them the rows are sliced on that device. Context parallelism splits each row's
positions too (`mesh.student.cp`, `mesh.teacher.cp`): blocks are then rows x positions and
the same rules hold for them (a teacher and a student with equal row splits and equal cp:
one copy per device, no row ever whole on one device), each part cut to the destination's
positions on the teacher's device before it moves. Meshes over several processes (a
colocated Ray group) hand over this way where each process holds the blocks its devices
receive; elsewhere (the teacher's cp across the processes, the student's rows within one)
every process takes JAX's own reshard, a collective over the group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Rows = tuple[int, int]  # [start, stop) of the leading axis (or of the positions, axis 1)
Block = tuple[Rows, Rows]  # (rows, positions) of a shard


def hop(tree, sharding):
    """Each array of `tree` placed on `sharding` (host arrays: one host-to-device put)."""
    return jax.tree.map(lambda x: _hop(x, sharding), tree)


def row_blocks(index: tuple, shape: tuple[int, ...]) -> Rows | None:
    """The rows a shard's index covers, or None if it splits any axis but the first."""
    if any(s.indices(n)[:2] != (0, n) for s, n in zip(index[1:], shape[1:], strict=True)):
        return None
    return index[0].indices(shape[0])[:2]


def blocks(index: tuple, shape: tuple[int, ...]) -> Block | None:
    """(rows, positions) a shard's index covers, or None if it splits any axis after the
    second (positions: the whole row unless context parallelism splits it)."""
    if len(shape) < 2:
        rows = row_blocks(index, shape)
        return None if rows is None else (rows, (0, 1))
    if row_blocks((index[0], slice(None), *index[2:]), shape) is None:
        return None
    return index[0].indices(shape[0])[:2], index[1].indices(shape[1])[:2]


def _hop(x, sharding):
    if not isinstance(x, jax.Array) or x.sharding == sharding:
        return jax.device_put(x, sharding)
    if not x.is_fully_addressable and not _within_processes(x, sharding):
        return jax.device_put(x, sharding)  # JAX's reshard across processes (a collective)
    src: dict[Block, jax.Array] = {}
    local: dict[tuple[Block, object], jax.Array] = {}  # (block, device): that device's
    for shard in x.addressable_shards:
        block = blocks(shard.index, x.shape)
        if block is None:  # not batch-major: JAX's own reshard (may go through the host)
            return jax.device_put(x, sharding)
        src.setdefault(block, shard.data)
        local[block, shard.device] = shard.data
    indices = sharding.addressable_devices_indices_map(x.shape)
    dst = {device: blocks(index, x.shape) for device, index in indices.items()}
    if None in dst.values():
        return jax.device_put(x, sharding)
    if all((block, device) in local for device, block in dst.items()):
        # colocated meshes whose blocks agree: each device keeps its buffer, no copy
        shards = [local[block, device] for device, block in dst.items()]
        return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)
    if all(block in src for block in dst.values()):
        return jax.device_put(x, sharding)  # one buffer copy per destination device
    shards = [_assemble(src, local, block, device, x.ndim) for device, block in dst.items()]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def _within_processes(x, sharding) -> bool:
    """Whether each destination block is covered by source blocks of its own device's
    process (so every process makes its shards from its own buffers). The same answer in
    every process of a multi-process mesh: where it is False, they all reshard together."""
    held: dict[int, set] = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        held.setdefault(device.process_index, set()).add(blocks(index, x.shape))
    for device, index in sharding.devices_indices_map(x.shape).items():
        block, mine = blocks(index, x.shape), held.get(device.process_index, set())
        if block is None or None in mine:
            return False
        if sum(_area(_overlap(block, o)) for o in mine) != _area(block):
            return False
    return True


def _overlap(a: Block, b: Block) -> Block:
    return tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))


def _area(block: Block) -> int:
    return max(block[0][1] - block[0][0], 0) * max(block[1][1] - block[1][0], 0)


def _assemble(src: dict[Block, jax.Array], local: dict, block: Block, device, ndim: int):
    """The rows [a, b) and positions [c, d) of `block` on `device`: from a block the device
    holds itself where one covers them (colocated meshes: sliced there, nothing crosses
    devices), else the overlapping part of each source block (sliced on its own device, so
    no device receives more than its share), copied over and put together there (along the
    positions within each band of rows, then the bands)."""

    def cut(buf, origin: Block, part: Block):
        for axis, ((lo, hi), (o, _)) in enumerate(zip(part, origin, strict=True)):
            if axis < ndim and (lo, hi) != origin[axis]:
                buf = jax.lax.slice_in_dim(buf, lo - o, hi - o, axis=axis)
        return buf

    for (rows, cols), dev in local:
        if dev == device and _inside(block, (rows, cols)):
            return cut(local[(rows, cols), dev], (rows, cols), block)
    bands: dict[Rows, list] = {}
    for origin, buf in sorted(src.items()):
        part = _overlap(block, origin)
        if all(lo < hi for lo, hi in part):
            bands.setdefault(part[0], []).append(jax.device_put(cut(buf, origin, part), device))
    rows = [p[0] if len(p) == 1 else jnp.concatenate(p, axis=1) for _, p in sorted(bands.items())]
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows)


def _inside(inner: Block, outer: Block) -> bool:
    return all(s0 <= a and b <= s1 for (a, b), (s0, s1) in zip(inner, outer, strict=True))
