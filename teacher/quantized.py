"""Released quantized checkpoints, read as the dequantized tensors they stand for, one slice
at a time (numpy and the safetensors file format; no JAX, no torch).

Two layouts, named by config.json's `quantization_config.quant_method`:

- `fp8` with `weight_block_size` [128, 128] (DeepSeek-V3/V3.1/R1, Kimi K2): a quantized
  Linear's `X.weight` is float8_e4m3fn [out, in] beside `X.weight_scale_inv` [ceil(out/128),
  ceil(in/128)] (float32; or e8m0 bytes); the weight is `weight * scale_inv` per 128 x 128
  block, the edge blocks partial. Which tensors are quantized is read from the file (a
  float8 tensor must have its scale); embeddings, norms, the router and the head are bf16.
- `mxfp4` (gpt-oss): an expert projection `X` is stored as `X_blocks` uint8 [E, R, G, 16]
  (two e2m1 values a byte, low nibble first: 32 values a block) and `X_scales` uint8
  [E, R, G] (e8m0: 2^(s - 127) per block); the logical tensor is transformers' unquantized
  parameter, unpacked to [E, R, G*32] and transposed to [E, G*32, R] ([E, D, 2F] for
  `mlp.experts.gate_up_proj` with gate at even and up at odd columns, [E, F, D] for
  `mlp.experts.down_proj`), as `transformers.integrations.mxfp4.convert_moe_packed_tensors`
  gives it.

`Checkpoint(path).slice(name, dtype)` is a safetensors-like slice of the logical tensor:
`get_shape()`, and `[index]` reading only the stored rows and blocks that index touches
(memory-mapped, mapped per read, so no pages stay mapped between reads) and dequantizing
them in float32 before one cast to `dtype`, the way transformers and DeepSeek's own kernels
dequantize. safetensors' numpy reader cannot return float8 (numpy has no such dtype), so
the files are read here from their header (a little-endian u64 length, a JSON table of
dtype, shape and byte offsets) with ml_dtypes' dtypes. (transformers' own loading op,
`Fp8Dequantize`, takes the block from the scale grid, so it is wrong on partial edge blocks,
or refuses them as for DeepSeek-V3's [576, 7168] `kv_a_proj_with_mqa`; its
`_dequantize_fp8_weight` does 128-blocks right, and is what the tests compare with.)

`quantized_shapes(path)` gives the logical shapes from the headers alone, for the
checkpoint checks; `Strided` views a slice's every other column (gpt-oss's gate and up).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from distill.errors import DistillError
from distill.models import hf
from distill.models.hf import files as hf_files

METHODS = ("fp8", "mxfp4")
MX_BLOCK = 32  # values per e8m0 scale: 16 bytes of two e2m1 nibbles
# e2m1 (FP4) code -> value: transformers' FP4_VALUES (sign bit 3, then 2 exponent bits, 1
# mantissa bit).
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
# e4m3 byte -> float32 value (NaN codes included): a lookup runs faster than ml_dtypes' cast.
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32,
    "I64": np.int64, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}  # fmt: skip
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
# Block rows (fp8) or experts (mxfp4) of one slice are dequantized on this many threads
# (numpy releases the GIL in its lookups, products and casts): on a many-core host the
# dequantization keeps up with the disk. Each holds one block row or expert at a time.
_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
THREADS = min(8, len(_CPUS))
_pools: dict[int, ThreadPoolExecutor] = {}  # by THREADS, made on first use

Index = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A checkpoint's quantization, from config.json: `method` one of METHODS, `block` the
    fp8 scale block [rows, cols] (None for mxfp4, whose blocks are 32 values of a row)."""

    method: str
    block: tuple[int, int] | None = None


def scheme_of(raw: dict, where: Path | str) -> Scheme | None:
    """The quantization config.json's `quantization_config` describes (None: none), or a
    DistillError naming `where` for a layout this reader does not support."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in METHODS:
        raise DistillError(
            f"{where}: quantization_config.quant_method {method!r} is not supported (only "
            f"released {' and '.join(METHODS)} checkpoints are read; or give a bf16 one)"
        )
    if method == "mxfp4":
        return Scheme("mxfp4")
    block = q.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(b > 0 for b in block)):
        raise DistillError(
            f"{where}: quantization_config.weight_block_size {block!r}: only block-scaled fp8 "
            "([rows, cols] per scale, e.g. [128, 128]) is read"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise DistillError(
            f"{where}: quantization_config.fmt {q['fmt']!r} is not supported (only e4m3)"
        )
    if q.get("expert_dtype", "fp8") != "fp8":
        raise DistillError(
            f"{where}: quantization_config.expert_dtype {q['expert_dtype']!r} is not supported "
            "(only fp8 experts)"
        )
    return Scheme("fp8", (int(block[0]), int(block[1])))


def read_scheme(path: str | Path) -> Scheme | None:
    """`scheme_of` a checkpoint directory's config.json (None without one)."""
    where = hf.config_file(path)
    if not where.is_file():
        return None
    try:
        raw = json.loads(where.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DistillError(f"{where}: not readable JSON: {e}") from None
    return scheme_of(raw, where)


@dataclasses.dataclass(frozen=True)
class Stored:
    """One stored tensor: its file, safetensors dtype name, shape, and its bytes' offset in
    the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int

    def read(self, index: Index) -> np.ndarray:
        """`index` (basic slices) of the tensor, copied out of a mapping made for this read:
        only the pages holding those elements are touched."""
        if 0 in self.shape:  # nothing to map
            return np.empty(self.shape, DTYPES[self.dtype])[index]
        mm = np.memmap(self.file, DTYPES[self.dtype], "r", self.offset, self.shape)
        return np.array(mm[index])


def read_header(file: Path) -> dict[str, Stored]:
    """Every tensor of one safetensors file, from its header alone."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise DistillError(f"{file}: not a safetensors file: {e}") from None
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        if t["dtype"] not in DTYPES:
            raise DistillError(f"{file}: {name} has dtype {t['dtype']}, which is not read")
        out[name] = Stored(file, t["dtype"], tuple(t["shape"]), 8 + n + t["data_offsets"][0])
    return out


class Checkpoint:
    """The logical tensors of a (quantized) safetensors checkpoint directory: what every
    stored name (and, for mxfp4, every `X` of an `X_blocks`/`X_scales` pair) stands for,
    checked against `scheme` from the headers alone when opened."""

    def __init__(self, path: str | Path, scheme: Scheme | None = None):
        self.root = Path(path)
        self.scheme = read_scheme(path) if scheme is None else scheme
        self.stored: dict[str, Stored] = {}
        for file in sorted(set(hf_files.weight_files(self.root).values())):
            if not (self.root / file).is_file():
                raise DistillError(f"{self.root / file}: listed in {hf.INDEX_FILE} but missing")
            header = read_header(self.root / file)
            # an image-text checkpoint: the text model's tensors, as a text model names them
            if hf_files.image_text(self.root):
                named = ((hf_files.decoder_name(n), t) for n, t in header.items())
                header = {n: t for n, t in named if n is not None}
            self.stored.update(header)
        self.quantized: dict[str, tuple[int, ...]] = {}  # logical name -> logical shape
        for name, t in self.stored.items():
            if self.scheme is not None and self.scheme.method == "fp8":
                self._check_fp8(name, t)
            elif self.scheme is not None and name.endswith("_blocks"):
                self._check_mxfp4(name.removesuffix("_blocks"), t)

    def _check_fp8(self, name: str, t: Stored) -> None:
        if t.dtype == "F8_E5M2":
            raise DistillError(f"{t.file}: {name} is float8_e5m2; only e4m3 is read")
        if t.dtype != "F8_E4M3":
            return
        scale = self.stored.get(_scale_name(name))
        if scale is None:
            raise DistillError(f"{t.file}: {name} is float8 without its {_scale_name(name)}")
        if len(t.shape) < 2:
            raise DistillError(f"{t.file}: {name} is float8 of shape {t.shape}: not a matrix")
        bm, bn = self.scheme.block
        *lead, rows, cols = t.shape
        want = (*lead, -(-rows // bm), -(-cols // bn))
        if scale.shape != want or scale.dtype not in SCALE_DTYPES:
            raise DistillError(
                f"{scale.file}: {_scale_name(name)} is {scale.dtype} {scale.shape}; config.json's "
                f"weight_block_size [{bm}, {bn}] over {name} {t.shape} needs {want} float32"
            )
        self.quantized[name] = t.shape

    def _check_mxfp4(self, name: str, blocks: Stored) -> None:
        scales = self.stored.get(name + "_scales")
        if scales is None:
            raise DistillError(f"{blocks.file}: {name}_blocks without its {name}_scales")
        if (
            blocks.dtype != "U8"
            or scales.dtype != "U8"
            or len(blocks.shape) != 4
            or blocks.shape[-1] != MX_BLOCK // 2
            or scales.shape != blocks.shape[:-1]
        ):
            raise DistillError(
                f"{blocks.file}: {name}_blocks {blocks.dtype} {blocks.shape} with {name}_scales "
                f"{scales.dtype} {scales.shape}: mxfp4 needs uint8 [E, R, G, 16] and [E, R, G]"
            )
        e, r, g, _ = blocks.shape
        self.quantized[name] = (e, g * MX_BLOCK, r)

    def file_of(self, name: str) -> str:
        """The file (relative to the directory) holding `name`'s stored data."""
        t = self.stored.get(name) or self.stored[name + "_blocks"]
        return str(t.file.relative_to(self.root))

    def slice(self, name: str, dtype=None):
        """A slice object of the logical tensor `name` (`get_shape()`, `[index]`) whose reads
        come in `dtype` (None: bfloat16 for a quantized tensor, else as stored)."""
        if name not in self.quantized:
            return _Plain(self.stored[name], dtype)
        dtype = ml_dtypes.bfloat16 if dtype is None else dtype
        if self.scheme.method == "fp8":
            scale = self.stored[_scale_name(name)]
            return _Fp8(self.stored[name], scale, self.scheme.block, dtype)
        blocks, scales = self.stored[name + "_blocks"], self.stored[name + "_scales"]
        return _Mxfp4(blocks, scales, self.quantized[name], dtype)


def quantized_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Logical name -> logical shape of every quantized tensor of a checkpoint directory,
    from its headers, for the checkpoint checks: an fp8 `X.weight` keeps its stored shape;
    an mxfp4 `X` is [E, in, out] from `X_blocks`. Empty when the checkpoint is not
    quantized; a DistillError for a layout that cannot be read. (distill/ may not import
    teacher/: its callers in teacher/ and pipelines/ hand the result to the check.)"""
    if read_scheme(path) is None:
        return {}
    return dict(Checkpoint(path).quantized)


def _each(fn, items) -> None:
    """fn(*item) for every item, on `THREADS` threads (in order, here, with one); an error
    in any is raised."""
    items = list(items)
    if THREADS == 1 or len(items) == 1:
        for item in items:
            fn(*item)
        return
    if THREADS not in _pools:
        _pools[THREADS] = ThreadPoolExecutor(THREADS, thread_name_prefix="dequantize")
    for _ in _pools[THREADS].map(lambda item: fn(*item), items):
        pass


def _scale_name(name: str) -> str:
    """`X.weight` -> `X.weight_scale_inv`, as transformers' Fp8Quantize names it."""
    return name + "_scale_inv"


def _ranges(index: Index, shape: tuple[int, ...]) -> list[range]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return [range(*s.indices(n)) for s, n in zip(index, shape, strict=True)]


def _basic(r: range) -> slice:
    return slice(r.start, r.stop, r.step) if len(r) else slice(0, 0)


class _Plain:
    """An unquantized tensor's slice, converted to `dtype` (None: as stored)."""

    def __init__(self, t: Stored, dtype):
        self.t, self.dtype = t, dtype

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, index: Index) -> np.ndarray:
        x = self.t.read(tuple(map(_basic, _ranges(index, self.t.shape))))
        return x if self.dtype is None else x.astype(self.dtype, copy=False)


class _Fp8:
    """A block-scaled float8 weight [..., out, in] as `weight * scale_inv` per block, read one
    block row at a time on each thread: beyond the output slice the host holds the slice's
    scales and, per thread, one block row of the slice in float8 and in float32."""

    def __init__(self, weight: Stored, scale: Stored, block: tuple[int, int], dtype):
        self.w, self.s, self.block, self.dtype = weight, scale, block, dtype

    def get_shape(self) -> list[int]:
        return list(self.w.shape)

    def __getitem__(self, index: Index) -> np.ndarray:
        bm, bn = self.block
        *lead, rows, cols = _ranges(index, self.w.shape)
        out = np.empty(tuple(map(len, (*lead, rows, cols))), self.dtype)
        if out.size == 0:
            return out
        lead_at, cols_at = tuple(map(_basic, lead)), _basic(cols)
        # the scale blocks the slice touches, and each output column's block among them
        rb, cb = rows[0] // bm, cols[0] // bn
        s_at = (*lead_at, slice(rb, rows[-1] // bm + 1), slice(cb, cols[-1] // bn + 1))
        s = self.s.read(s_at).astype(np.float32)
        col_block = np.asarray(cols) // bn - cb
        row_block = np.asarray(rows) // bm - rb
        # rows of one block are contiguous in the output, whatever the slice's step
        starts = np.flatnonzero(np.diff(row_block, prepend=-1))

        def block_row(a: int, b: int) -> None:
            part = E4M3_VALUES[self.w.read((*lead_at, _basic(rows[a:b]), cols_at)).view(np.uint8)]
            part *= s[..., row_block[a], col_block][..., None, :]
            out[..., a:b, :] = part  # one rounding, float32 -> dtype

        _each(block_row, zip(starts, [*starts[1:], len(rows)], strict=True))
        return out


class _Mxfp4:
    """An mxfp4 expert projection, logical [E, in, out] from blocks [E, out, in/32, 16]: each
    expert's rows read, unpacked and scaled in float32, transposed into the output (the
    host holds the output slice and, per thread, one expert's slice in float32)."""

    def __init__(self, blocks: Stored, scales: Stored, shape: tuple[int, ...], dtype):
        self.b, self.s, self.shape, self.dtype = blocks, scales, shape, dtype

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Index) -> np.ndarray:
        experts, ins, outs = _ranges(index, self.shape)
        out = np.empty((len(experts), len(ins), len(outs)), self.dtype)
        if out.size == 0:
            return out
        g0, g1 = ins[0] // MX_BLOCK, ins[-1] // MX_BLOCK + 1  # the 32-value groups touched
        skip = g0 * MX_BLOCK
        cols = _basic(range(ins.start - skip, ins.stop - skip, ins.step))  # within the groups

        def expert(i: int, e: int) -> None:
            at = (slice(e, e + 1), _basic(outs), slice(g0, g1))
            packed = self.b.read(at)[0]  # [R', G', 16]
            exp = self.s.read(at)[0].astype(np.int32) - 127  # [R', G']
            values = np.empty((*packed.shape[:2], MX_BLOCK), np.float32)
            values[..., 0::2] = FP4_VALUES[packed & 0x0F]  # low nibble first
            values[..., 1::2] = FP4_VALUES[packed >> 4]
            with np.errstate(over="ignore"):  # exponents near 255 give inf, as in transformers
                np.ldexp(values, exp[..., None], out=values)
            out[i] = values.reshape(len(outs), -1)[:, cols].T  # one rounding to dtype

        _each(expert, enumerate(experts))
        return out


class Strided:
    """Every `step`-th entry from `start` along `axis` of a slice object (`get_shape()`,
    `[index]`), as a slice object of its own: gpt-oss's gate (`start` 0) and up (1) halves
    of the interleaved columns of `mlp.experts.gate_up_proj` [E, D, 2F], each read on its
    own and split over `tp` like any [E, D, F] weight; with `stop`, entries up to it only
    (Qwen3.5's q, k and v rows of `in_proj_qkv`, step 1)."""

    def __init__(self, sl, axis: int, start: int, step: int, stop: int | None = None):
        self.sl, self.start, self.step = sl, start, step
        shape = list(sl.get_shape())
        self.axis = axis % len(shape)
        end = shape[self.axis] if stop is None else stop
        self.shape = [*shape[: self.axis], len(range(start, end, step))]
        self.shape += shape[self.axis + 1 :]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Index) -> np.ndarray:
        ranges = _ranges(index, tuple(self.shape))
        r = ranges[self.axis]
        lo, step = self.start + r.start * self.step, r.step * self.step
        ranges[self.axis] = range(lo, lo + (len(r) - 1) * step + 1 if len(r) else lo, step)
        return self.sl[tuple(map(_basic, ranges))]
