"""Load a Hugging Face Llama checkpoint straight into the teacher's tensor-parallel layout
(on a `dp` x `tp` inference mesh: split over `tp`, replicated over `dp`).

Nothing is materialised whole on a host. The safetensors files are opened one at a time
(memory-mapped: a read touches only the bytes of the slice it asks for). Each tensor
becomes a sharded array through `jax.make_array_from_callback`, whose per-device callback
reads just that device's slice with `get_slice(name)[...]`. A top-level tensor (embedding,
final norm, LM head) is read straight in distill's [in, out] layout, the LM head transposed
on the host one device slice at a time. A layer's tensor, one layer at a time, is read in
its stored [out, in] layout, transposed on the devices (the split axis moves with it, so
this is shard-local) and written in place (donated) into its slot of a preallocated
stacked [L, ...] array; waiting for that write before reading the next tensor keeps reads
from running ahead of the devices.

So the host holds at most one file's touched pages plus one device's slice of a tensor, and
the devices the weights plus one layer's tensor (`python -m teacher.load_bench`: a 0.98 GB
bf16 checkpoint in 0.25 GB shards, tp=4 on CPU devices: 0.29 GB mapped pages and 0.11 GB
other memory beyond the weights at the peak). Each stored byte is read once, except that
with fewer KV heads than `tp` each KV head is read once per shard that uses it, giving the
layout of `teacher.sharding.expand_kv_heads`. With `dp` > 1 the dp groups' devices that hold
the same slice get the same host array (`_once_per_index`): read once, copied dp times.
With pipeline stages (`pp`) a layer's tensor is read only by the devices of the stage that
holds the layer (`_load_layer`): in a teacher group of processes, one per stage, each reads
only its own layers (and the embedding, norm and head that every stage holds).

A released quantized checkpoint (config.json's `quantization_config`: DeepSeek's block fp8,
gpt-oss's mxfp4) is read the same way through `teacher.quantized`, whose slices dequantize
just the stored blocks a device's slice covers, straight into the held dtype.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for safetensors' numpy reader)
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from distill.config import ModelConfig
from distill.mesh import PP, TP
from distill.models import hf, parts
from distill.models.hf import files as hf_files
from teacher import quantized, sharding, stages

Index = tuple[slice, ...]


def load_hf_teacher(path: str | Path, cfg: ModelConfig, mesh, *, dtype=None) -> dict:
    """Teacher parameters on `mesh` in the layout of `teacher.sharding.shardings`.

    `dtype` None keeps each tensor's stored dtype (bfloat16 stays bfloat16; the model casts
    weights to the compute dtype where it uses them); a dtype converts while reading.
    """
    tp = mesh.shape[TP]
    hf_files.check_checkpoint(path, cfg, tp, quantized.quantized_shapes(path))
    targets = sharding.shardings(cfg, mesh)
    needed, stored = hf.weight_names(cfg), _quantized(path)
    files = _files(path, needed, stored)
    by_file: dict[str, list[str]] = {}
    for name in needed:
        by_file.setdefault(files[name], []).append(name)

    params: dict = {"layers": {}}
    for file in sorted(by_file):
        with _slices(Path(path) / file, stored, dtype) as get_slice:
            for name in by_file[file]:
                key, layer, transposed = needed[name]
                key_reps, hd = sharding.kv_layout(cfg, key, tp)  # copies of each KV head
                read = _reader(_tensor(get_slice, name), key_reps, hd, dtype)
                shape = _stored_shape(cfg, key, key_reps)
                if layer is None:  # transposed on the host, one device's slice at a time
                    layout = shape[::-1] if transposed else shape
                    read = _transposed(read) if transposed else read
                    params[key] = jax.make_array_from_callback(
                        layout, targets[key], _once_per_index(read)
                    )
                    continue
                target = targets["layers"][key]
                slot = layer if isinstance(layer, tuple) else (layer,)  # (layer, expert)
                stacked = params["layers"].get(key)
                stacked = _load_layer(cfg, key, target, stacked, read, shape, slot, transposed)
                params["layers"][key] = stacked.block_until_ready()
    return params


def _files(path, needed: dict, stored: quantized.Checkpoint | None) -> dict[str, str]:
    """`weight_names` name -> the file holding its stored tensor."""
    if stored is None:
        files = hf_files.weight_files(path)
        return {n: files[hf.stored(n)[0]] for n in needed}
    return {n: stored.file_of(hf.stored(n)[0]) for n in needed}


def _tensor(get_slice, name: str):
    """The slice object of a `weight_names` name: its stored tensor's, or every other
    column of it (`hf.VIEW`: gpt-oss's interleaved gate and up)."""
    base, view = hf.stored(name)
    sl = get_slice(base)
    if isinstance(view, tuple):  # rows [start, stop) (`hf.ROWS`)
        return quantized.Strided(sl, 0, view[0], 1, view[1])
    if isinstance(view, slice):  # columns [start, stop) (`hf.COLS`)
        return quantized.Strided(sl, -1, view.start, 1, view.stop)
    if isinstance(view, range):  # each expert's rows [start, stop) (`hf.HALVES`)
        return quantized.Strided(sl, 1, view.start, 1, view.stop)
    return sl if view is None else quantized.Strided(sl, -1, view, 2)


def _quantized(path: str | Path) -> quantized.Checkpoint | None:
    """The checkpoint's logical tensors when config.json says it is quantized (fp8 blocks,
    mxfp4), read dequantized through `teacher.quantized`; None: read as stored."""
    return None if quantized.read_scheme(path) is None else quantized.Checkpoint(path)


@contextlib.contextmanager
def _slices(file: Path, stored: quantized.Checkpoint | None, dtype):
    """name -> a slice object of that tensor of `file` (`get_shape()`, `[index]`):
    safetensors' own, or for a quantized checkpoint the dequantizing one, in `dtype`."""
    if stored is not None:
        yield functools.partial(stored.slice, dtype=dtype)
        return
    image = hf_files.image_text(file.parent)
    with safe_open(file, framework="numpy") as f:
        yield lambda name: f.get_slice(hf_files.stored_name(name, image))


def _load_layer(cfg: ModelConfig, key, target, stacked, read, shape, slot, transposed: bool):
    """`stacked` (None: not made yet) with one layer's tensor (or one expert's) read into
    `slot`. With pipeline stages, only the devices of the stage holding the layer read it
    (`_in_stage`): in a group of several processes, a stage's process reads only its own
    layers' tensors."""
    pp, lead = target.mesh.shape.get(PP, 1), (1,) * len(slot)
    stored = _as_stored(target, transposed, len(slot))
    read = _once_per_index(_leading(read, len(slot)))
    layers = stages.stacked_layers(cfg.n_layers, pp)  # zero layers past n_layers
    if pp == 1:  # each part stacked over the layers holding it (`parts.apart`)
        layers, slot = parts.stack_size(cfg, key), (parts.layer_slot(cfg, key, slot[0]), *slot[1:])
    if pp > 1:  # a leading slot per stage, read only in the layer's own
        stage = slot[0] // (layers // pp)
        stored = NamedSharding(target.mesh, P(PP, *stored.spec))
        whole = (pp, *lead, *shape)
        one = jax.make_array_from_callback(whole, stored, _in_stage(read, stage, whole))
    else:
        one = jax.make_array_from_callback((*lead, *shape), stored, read)
    if stacked is None:
        layout = _swap(shape) if transposed else shape
        outer = (layers, cfg.n_experts)[: len(slot)]
        stacked = jnp.zeros((*outer, *layout), one.dtype, device=target)
    if pp > 1:
        return _set_staged(stacked, one, slot, transposed)
    return _set_layer(stacked, one, tuple(map(np.int32, slot)), transposed)


def _in_stage(read: Callable[[Index], np.ndarray], stage: int, shape) -> Callable:
    """The callback of a [pp, ...] array of `shape` with one slot per stage: the tensor read
    into slot `stage`, zeros (nothing of it read) in the others'."""
    dtype = read((slice(0, 1),) * (len(shape) - 1)).dtype  # one element, for the zeros

    def callback(index: Index) -> np.ndarray:
        if index[0].indices(shape[0])[0] == stage:
            return read(index[1:])[None]
        return np.zeros(
            [len(range(*i.indices(n))) for i, n in zip(index, shape, strict=True)], dtype
        )

    return callback


def read_hf_layers(
    path: str | Path, cfg: ModelConfig, layers: list[int], shardings=None, *, dtype=np.float32
) -> dict:
    """Parameters in distill's layout of the model made of the checkpoint's embeddings,
    final norm, head and `layers` (in that order), in `dtype`: depth pruning for
    `student.init: from_teacher` (every layer: a pretrained student). Only the tensors kept
    are read, each straight into its placement: `shardings` (a tree like the kept model's
    parameters, e.g. the student's on its mesh; None: the host's CPU device).

    Each parameter is made one device at a time (`_placed`): that device's slice of each
    kept layer read from the memory-mapped file, converted to `dtype` into one array,
    placed, and dropped before the next device's: beyond the arrays themselves the host
    holds one device's slice of one parameter and one layer's stored slice, never a whole
    tensor converted, nor the model (tests/test_host_copies.py)."""
    hf_files.check_checkpoint(path, cfg, 1, quantized.quantized_shapes(path))
    needed, stored = hf.weight_names(cfg), _quantized(path)
    files = _files(path, needed, stored)
    parts: dict[str, dict[tuple, tuple[str, str, bool]]] = {}  # key -> {(slot[, expert]): ...}
    for name, (key, layer, transposed) in needed.items():
        i, expert = layer if isinstance(layer, tuple) else (layer, None)
        slot = _kept_slot(cfg, key, layers, i)
        if layer is not None and slot is None:
            continue
        at = () if layer is None else (slot,) if expert is None else (slot, expert)
        parts.setdefault(key, {})[at] = (files[name], name, transposed)
    host = SingleDeviceSharding(jax.devices("cpu")[0])
    params: dict = {"layers": {}}
    for key, kept in parts.items():
        lead = len(next(iter(kept)))  # 0: a top-level tensor; 1: a layer's; 2: an expert's
        shape = hf.hf_shape(cfg, key)
        shape = _swap(shape) if next(iter(kept.values()))[2] else shape
        shape = (*(_kept_size(cfg, key, layers), cfg.n_experts)[:lead], *shape)
        tree = params if lead == 0 else params["layers"]
        where = (
            host if shardings is None else (shardings if lead == 0 else shardings["layers"])[key]
        )
        read = _kept_slices(Path(path), kept, shape, lead, dtype, stored)
        tree[key] = _placed(shape, where, read)
    return params


def _kept_slot(cfg: ModelConfig, key: str, layers: list[int], layer: int | None) -> int | None:
    """Layer `layer`'s slot in the stack of weight `key` of the model made of `layers`
    (`read_hf_layers`): its rank among the kept layers holding that weight's part
    (`parts.apart`; the kept layers all, where each holds it); None: not kept."""
    if layer is None or layer not in layers:
        return None
    holds = parts.part_layers(cfg, parts.weight_part(key))
    return sum(holds[i] for i in layers[: layers.index(layer)])


def _kept_size(cfg: ModelConfig, key: str, layers: list[int]) -> int:
    """How many of the kept `layers` hold weight `key` (its stack's length)."""
    holds = parts.part_layers(cfg, parts.weight_part(key))
    return sum(holds[i] for i in layers)


def _placed(shape: tuple[int, ...], where, read: Callable[[Index], np.ndarray]) -> jax.Array:
    """`jax.make_array_from_callback`, one device at a time: each distinct slice is read,
    placed and dropped before the next is read (the callback API reads every device's slice
    before placing any: a whole tensor on the host), and a device holding a slice already
    placed (a replica) gets a device-to-device copy of it."""
    arrays, placed = [], {}
    for device, index in where.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)  # slices hash from 3.12 only
        src = placed.get(key)
        arrays.append(jax.device_put(read(index) if src is None else src, device))
        placed.setdefault(key, arrays[-1])
    return jax.make_array_from_single_device_arrays(shape, where, arrays)


def _kept_slices(
    root: Path,
    kept: dict[tuple, tuple[str, str, bool]],
    shape: tuple[int, ...],
    lead: int,
    dtype,
    stored: quantized.Checkpoint | None = None,
) -> Callable[[Index], np.ndarray]:
    """index in distill's layout (`shape`: `lead` axes of slots, then [in, out]) -> that
    slice of the parameter stacked from the `kept` tensors ({(slot[, expert]): (file, name,
    transposed)}): each layer's slice read at the mirrored index of its stored [out, in]
    tensor and written, converted, into the one output array. A slot without a tensor (the
    dense feed-forward of a mixture-of-experts layer) stays zero. A quantized checkpoint's
    tensors (`stored`) are read dequantized."""
    transposed = next(iter(kept.values()))[2]

    def read(index: Index) -> np.ndarray:
        ranges = [range(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
        out = np.zeros(tuple(map(len, ranges)), dtype)
        inner = tuple(index[lead:])
        at_stored = _swap(inner) if transposed else inner
        for at in itertools.product(*(enumerate(r) for r in ranges[:lead])):
            part = kept.get(tuple(i for _, i in at))
            if part is None:
                continue
            with _slices(root / part[0], stored, dtype) as get_slice:
                x = _tensor(get_slice, part[1])[at_stored]  # only this slice's bytes are read
            out[tuple(j for j, _ in at)] = np.swapaxes(x, -1, -2) if transposed else x
        return out

    return read


def _swap(axes: tuple) -> tuple:
    """`axes` (a shape or an index) with its last two swapped: a stored [out, in] tensor's
    (or each expert's of a fused [E, out, in] one) in distill's [in, out] layout."""
    return (*axes[:-2], axes[-1], axes[-2]) if len(axes) >= 2 else tuple(axes)


def _stored_shape(cfg: ModelConfig, key: str, reps: int) -> tuple[int, ...]:
    """The stored shape of one layer's (or a top-level) weight, KV heads repeated `reps`."""
    rows, *rest = hf.hf_shape(cfg, key)
    return (rows * reps, *rest)


def _as_stored(target: NamedSharding, transposed: bool, lead: int = 1) -> NamedSharding:
    """The sharding of one stored tensor, with `lead` leading axes of size 1 (its layer, its
    expert), in the stored [out, in] layout whose transpose has `target`'s layout. The
    size-1 axes are unsplit (one expert is not split over `ep`); the axes between them and
    the last keep `target`'s split: a layer's fused experts, read whole ([E, in, out], as
    gpt-oss stores them) into slot `(layer,)` of a [L, E, ...] parameter, stay split over
    `ep`."""
    inner = tuple(target.spec)[lead:]  # the table's specs name every axis
    if transposed and len(inner) >= 2:
        inner = (*inner[:-2], inner[-1], inner[-2])
    return NamedSharding(target.mesh, P(*(None,) * lead, *inner))


def _reader(sl, reps: int, hd: int, dtype) -> Callable[[Index], np.ndarray]:
    """index in the stored layout -> that slice of the stored tensor, read from disk.

    With `reps` > 1 the stored rows are KV heads and the index addresses the repeated heads:
    repeated head e is stored head e // reps."""
    n_rows = sl.get_shape()[0] * reps

    def read(index: Index) -> np.ndarray:
        if reps == 1:
            x = sl[tuple(index)]
        else:
            start, stop, _ = index[0].indices(n_rows)
            parts = []
            for e in range(start // hd, -(-stop // hd)):
                lo, hi = max(start, e * hd), min(stop, (e + 1) * hd)
                base = (e // reps - e) * hd  # repeated row r is stored row r + base
                parts.append(sl[(slice(lo + base, hi + base), *index[1:])])
            x = np.concatenate(parts, axis=0)
        return x if dtype is None else x.astype(dtype, copy=False)

    return read


def _once_per_index(read: Callable[[Index], np.ndarray]) -> Callable[[Index], np.ndarray]:
    """A callback that reads each distinct slice once: on a mesh replicated over `dp`,
    `make_array_from_callback` asks for every slice once per dp group."""
    seen: dict[tuple, np.ndarray] = {}

    def read_once(index: Index) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)  # slices hash from 3.12 only
        if key not in seen:
            seen[key] = read(index)
        return seen[key]

    return read_once


def _leading(read: Callable[[Index], np.ndarray], n: int) -> Callable[[Index], np.ndarray]:
    """The callback of a [1, ...] single-layer array ([1, 1, ...]: one layer's expert)."""
    return lambda index: read(index[n:])[(None,) * n]


def _transposed(read: Callable[[Index], np.ndarray]) -> Callable[[Index], np.ndarray]:
    """The callback of the [in, out] layout of a stored [out, in] tensor: the device's
    slice, read at the mirrored index and transposed on the host (one slice at a time, so a
    large top-level tensor such as the LM head never exists twice on the devices)."""
    return lambda index: np.ascontiguousarray(read(tuple(index)[::-1]).T)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _set_layer(stacked_l: jax.Array, one_1: jax.Array, slot, transposed: bool) -> jax.Array:
    """stacked[slot] = one[0] (slot: a layer, or a layer and an expert; transposed from
    [out, in] on the devices), in place: the stacked buffer is donated."""
    one_1 = jnp.swapaxes(one_1, -1, -2) if transposed else one_1
    starts = (*slot, *(0,) * (stacked_l.ndim - len(slot)))
    return jax.lax.dynamic_update_slice(stacked_l, one_1.astype(stacked_l.dtype), starts)


def _set_staged(stacked_l: jax.Array, one_s: jax.Array, slot, transposed: bool) -> jax.Array:
    """`_set_layer` on a mesh with pipeline stages: `one_s` has a slot per stage, and only
    the stage holding layer `slot[0]` writes its slot into its own layers (no transfer
    between stages)."""
    s, o = stacked_l.sharding, one_s.sharding
    write = _staged_writer(s.mesh, s.spec, o.spec, stacked_l.shape[0], transposed)
    return write(stacked_l, one_s, tuple(map(np.int32, slot)))


@functools.cache
def _staged_writer(mesh, spec, one_spec, layers: int, transposed: bool):
    n = layers // mesh.shape[PP]  # layers per stage

    def write(stacked, one, slot):
        one = jnp.swapaxes(one[0], -1, -2) if transposed else one[0]
        # the slot's layer is in one stage; an expert's slot (layer, expert) also in one
        # `ep` shard of that stage's [L/pp, E/ep, ...] block: only that shard writes it
        mine, starts = jax.lax.axis_index(PP) == slot[0] // n, [slot[0] % n]
        for i in range(1, len(slot)):
            local = stacked.shape[i]
            if spec[i] is not None:
                mine &= jax.lax.axis_index(spec[i]) == slot[i] // local
            starts.append(slot[i] % local)
        starts += [0] * (stacked.ndim - len(slot))
        return jax.lax.cond(
            mine,
            lambda: jax.lax.dynamic_update_slice(stacked, one.astype(stacked.dtype), starts),
            lambda: stacked,
        )

    staged = jax.shard_map(write, mesh=mesh, in_specs=(spec, one_spec, P()), out_specs=spec)
    return jax.jit(staged, donate_argnums=0)
