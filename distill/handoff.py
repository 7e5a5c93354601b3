"""The hand-off between the roles: how large a teacher output is, and how it moves from one
mesh to the other, device to device.

Its sizing rules (below `hop`) are read by both roles' running objects and by the planner
alike: the bytes per token and step, the blocks a dense output is made in
(`dense_blocks`), the refusals of one too large for a device, and the chunks and position
windows of the dense eval logits (`eval_rows`, `eval_windows`).

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

import math

import jax
import jax.numpy as jnp

from distill.config import Config
from distill.errors import DistillError
from distill.limits import MAX_ELEMENTS, rows_that_fit
from distill.mesh import student_row_shards, student_size, teacher_size

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


# A chunk's dense float32 logits, per student device (teacher and student logits, and the
# log-softmax temporaries of the metrics, each of about this size).
EVAL_DEVICE_BYTES = 256 * 2**20


# Dense teacher outputs on a student device at once: the step's own and the next step's,
# which the loop hops over while the step runs (`pipelines.loop`, staged).
DENSE_BUFFERS = 2
# The share of a device's memory they may take; a CPU device reports none: a fixed budget.
DENSE_FRACTION = 0.25
CPU_DEVICE_BUDGET = 4 * 2**30


def teacher_output_bytes_per_token(cfg: Config) -> int:
    """Bytes of teacher output per token: float32 values and int32 ids of the top-k, or the
    float32 log-probs of the whole vocabulary."""
    k = cfg.teacher.top_k
    return k * 8 if k else cfg.teacher.model.vocab_size * 4


def teacher_output_bytes_per_step(cfg: Config) -> int:
    """Bytes crossing from the inference mesh to the training mesh per step."""
    return teacher_output_bytes_per_token(cfg) * cfg.train.batch_size * cfg.train.seq_len


def dense_output_bytes_per_device(cfg: Config) -> int:
    """Dense teacher outputs held on one student device: its rows x its positions (S, or
    S / cp) x V x 4 bytes, twice."""
    rows, positions = student_rows(cfg)
    return rows * positions * cfg.teacher.model.vocab_size * 4 * DENSE_BUFFERS


def student_rows(cfg: Config) -> tuple[int, int]:
    """(rows, positions of each) one student device holds of a training batch: its share
    of the rows (dp x fsdp), each row's S / cp positions."""
    return cfg.train.batch_size // student_row_shards(cfg), cfg.train.seq_len // cfg.mesh.student.cp


def dense_output_budget(device) -> tuple[int, str]:
    """(bytes the dense teacher outputs may take on a device like `device`, where from)."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        return CPU_DEVICE_BUDGET, f"the fixed budget of a {device.platform} device"
    return int(limit * DENSE_FRACTION), f"{DENSE_FRACTION:.0%} of {_gib(limit)} device memory"


def dense_rows_per_device(cfg: Config, rows: int | None = None) -> int:
    """The most rows one device holds of a dense teacher output of `rows` rows (default: the
    training batch): on the inference mesh (split over every device when they divide, else
    over dp x ep: `teacher.sharding.out_spec`) and on the training mesh."""
    t = cfg.mesh.teacher
    b = rows or cfg.train.batch_size
    teacher = b // teacher_size(cfg) if b % teacher_size(cfg) == 0 else b // (t.dp * t.ep)
    return max(teacher, b // student_size(cfg))


def _dense_elements(cfg: Config, n_blocks: int, teacher_len: int | None) -> tuple[int, int, int]:
    """(rows, positions, elements) of one device's array of a dense output in `n_blocks`."""
    s = max(cfg.train.seq_len, teacher_len or 0)
    rows = dense_rows_per_device(cfg, cfg.train.batch_size // n_blocks)
    return rows, s, rows * s * cfg.teacher.model.vocab_size


def dense_blocks(cfg: Config, teacher_len: int | None = None) -> int:
    """How many arrays a batch's dense teacher output is handed over in
    (`distill.types.TeacherOutput`): one while one array per device stays under
    MAX_ELEMENTS, else one per `train.grad_accum` microbatch (block j: rows j, j + n, ...,
    made by a teacher forward of its own and read by the student's microbatch j). One for
    a top-k output. `teacher_len`: across tokenizers, the teacher's own row length (known
    once the corpus is read); its output is [rows, T, V], read at [rows, S, V] positions."""
    if cfg.teacher.top_k is not None or cfg.teacher.source != "online":
        return 1
    return 1 if _dense_elements(cfg, 1, teacher_len)[2] < MAX_ELEMENTS else cfg.train.grad_accum


def check_dense_elements(cfg: Config, teacher_len: int | None = None) -> None:
    """Refuse a dense teacher output whose arrays (`dense_blocks`) would reach MAX_ELEMENTS
    on a device (`distill.limits`: GPU sorts and kernels index with 32 bits), in one line
    naming teacher.top_k and the rows a device that fit; or whose blocks the layout cannot
    make (the Ray hand-off takes one array; the teacher's dp x ep splits each block)."""
    n = dense_blocks(cfg, teacher_len)
    if n == 1 and (cfg.teacher.top_k is not None or cfg.teacher.source != "online"):
        return
    rows, s, elements = _dense_elements(cfg, n, teacher_len)
    v = cfg.teacher.model.vocab_size
    if elements >= MAX_ELEMENTS:
        fit = rows_that_fit(s, v)
        raise DistillError(
            f"teacher.top_k: null makes dense teacher outputs of {rows} rows x {s} tokens x "
            f"{v} ids = {elements:,} elements on a device (an array per train.grad_accum "
            f"microbatch), not under 2^31 (32-bit GPU indexing); at most {fit} rows a device "
            "and microbatch fit: raise train.grad_accum, lower train.batch_size or set "
            "teacher.top_k (e.g. --set teacher.top_k=64)"
        )
    if n == 1:
        return
    t, block = cfg.mesh.teacher, cfg.train.batch_size // n
    if cfg.pipeline.mode == "ray":
        raise DistillError(
            f"teacher.top_k: null makes a dense teacher output of {rows * n} rows x {s} x {v} "
            "ids on a device, past 2^31 elements as one array, and pipeline.mode ray hands it "
            "over whole; set teacher.top_k or use pipeline.mode local"
        )
    if block % (t.dp * t.ep):
        raise DistillError(
            f"train.grad_accum: the dense teacher output is made in {n} blocks of {block} rows "
            f"(one array per microbatch: whole it would reach 2^31 elements on a device), which "
            f"do not split over mesh.teacher.dp x ep = {t.dp * t.ep}"
        )


def check_dense_output(cfg: Config, device) -> None:
    """Refuse a dense teacher output too large for the student's devices (`device`: one of
    them), or for one array (`check_dense_elements`), in one line naming the figures and
    the way out."""
    check_dense_elements(cfg)
    if cfg.teacher.top_k is not None or cfg.teacher.source != "online":
        return
    need, (budget, where) = dense_output_bytes_per_device(cfg), dense_output_budget(device)
    if need > budget:
        rows, positions = student_rows(cfg)
        raise DistillError(
            f"teacher.top_k: null sends dense teacher log-probs, {rows} rows x "
            f"{positions} tokens x {cfg.teacher.model.vocab_size} ids x 4 B x "
            f"{DENSE_BUFFERS} buffers = {_gib(need)} per student device, over {where} "
            f"({_gib(budget)}); set teacher.top_k (e.g. --set teacher.top_k=64)"
        )


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def eval_rows(cfg: Config) -> int:
    """Rows per evaluation chunk: the largest divisor of `train.batch_size` that is a
    multiple of the student's row shards (dp x fsdp) and of the teacher's dp, keeping each
    student device's share of a chunk's logits under `EVAL_DEVICE_BYTES` (at least one row
    per device; `pipelines.evaluation`)."""
    bsz, n = cfg.train.batch_size, student_row_shards(cfg)
    step = math.lcm(n, cfg.mesh.teacher.dp)  # both divide bsz, so their lcm does
    row_bytes = cfg.train.seq_len * cfg.teacher.model.vocab_size * 4
    divisors = [r for r in range(step, bsz + 1, step) if bsz % r == 0]
    return max((r for r in divisors if r // n * row_bytes <= EVAL_DEVICE_BYTES), default=step)


def eval_windows(cfg: Config, length: int | None = None) -> int:
    """How many position windows each eval chunk's dense logits are made and compared in:
    the fewest, w, that keep one window's logits [eval_rows, S / w, V] under MAX_ELEMENTS
    (`distill.limits`: 32-bit GPU indexing), so no array ending in the vocabulary reaches
    it at any row length. Window j holds positions j, j + w, j + 2w, ... of every row: a
    strided window is a local slice of any contiguous split of the positions (`cp`'s row
    order and its load-balanced chunks alike) when w divides each chunk, so S / w must
    split into 2 x cp for each role's cp. `length`: the teacher's row length where it has
    its own tokens (cross-tokenizer), else `train.seq_len`. 1 (one window, the whole rows)
    wherever the rows fit; raises DistillError when no w fits."""
    s, v, rows = length or cfg.train.seq_len, cfg.teacher.model.vocab_size, eval_rows(cfg)
    cp = math.lcm(cfg.mesh.teacher.cp, cfg.mesh.student.cp)
    split = 2 * cp if cp > 1 else 1
    for w in range(1, s + 1):
        if s % w == 0 and (s // w) % split == 0 and rows * (s // w) * v < MAX_ELEMENTS:
            return w
    raise DistillError(
        f"train.seq_len: {s} tokens x {v} teacher ids: evaluation's logits of {rows} rows do "
        f"not split into position windows under 2^31 elements (32-bit GPU indexing)"
        + (f" that also split into 2 x cp = {split} chunks" if split > 1 else "")
    )
