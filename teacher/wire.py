"""The compact binary top-k exchange of `distill serve` (`POST /v1/distill/topk`), read by
`pipelines.serve.app` and written by distill's client (`teacher.endpoint`).

Both bodies are raw little-endian arrays after a 20-byte header: the magic `DTK1`, rows
R, row length L and k (uint32 each), and the temperature T of the log-probs (float32).

    request:  header, then int32 tokens [R, L], segment ids [R, L], positions [R, L]
    response: header, then int32 tokens [R, L] (the request's, echoed), float32 log-probs
              [R, L, k], int32 ids [R, L, k]

Position i of a response row is distill's convention (`distill.types.TeacherOutput`): the
k largest of log softmax(z / T) for the token after position i, given the row's tokens up
to i within its segment (segment id 0 is padding; positions restart with each segment). A response
is 8k + 4 bytes a position, against about 30k + 30 for the same numbers as JSON.
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = b"DTK1"
_HEADER = struct.Struct("<4sIIIf")
CONTENT_TYPE = "application/x-distill-topk"


class WireError(ValueError):
    """A body that is not a well-formed top-k request or response."""


def _header(body: bytes) -> tuple[int, int, int, float]:
    if len(body) < _HEADER.size:
        raise WireError(f"{len(body)} bytes: shorter than the {_HEADER.size}-byte header")
    magic, rows, length, k, temperature = _HEADER.unpack_from(body)
    if magic != MAGIC:
        raise WireError(f"magic {magic!r}, not {MAGIC!r}")
    if not temperature > 0:  # NaN too
        raise WireError(f"temperature {temperature}: must be > 0")
    return rows, length, k, float(temperature)


def _arrays(body: bytes, shapes: list[tuple[str, tuple[int, ...]]]) -> list[np.ndarray]:
    sizes = [int(np.prod(shape)) * 4 for _, shape in shapes]
    want = _HEADER.size + sum(sizes)
    if len(body) != want:
        raise WireError(f"{len(body)} bytes where the header says {want}")
    out, at = [], _HEADER.size
    for (dtype, shape), size in zip(shapes, sizes, strict=True):
        out.append(np.frombuffer(body, np.dtype(dtype).newbyteorder("<"), size // 4, at))
        out[-1] = out[-1].reshape(shape).astype(dtype)  # native order, writable
        at += size
    return out


def encode_request(tokens, segment_ids, positions, k: int, temperature: float = 1.0) -> bytes:
    """The request for rows `tokens`, `segment_ids`, `positions` [R, L]: `k` log-probs at
    `temperature`."""
    tokens = np.asarray(tokens)
    rows, length = tokens.shape
    parts = [np.asarray(a, "<i4").tobytes() for a in (tokens, segment_ids, positions)]
    return _HEADER.pack(MAGIC, rows, length, k, temperature) + b"".join(parts)


def decode_request(body: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, float]:
    """(tokens, segment ids, positions [R, L] int32, k, temperature) of a request body."""
    rows, length, k, temperature = _header(body)
    tokens, segments, positions = _arrays(body, [("int32", (rows, length))] * 3)
    return tokens, segments, positions, k, temperature


def encode_response(tokens, logprobs, ids, temperature: float) -> bytes:
    """The response: the echoed `tokens` [R, L], `logprobs` and `ids` [R, L, k]."""
    rows, length, k = np.shape(logprobs)
    parts = [np.asarray(tokens, "<i4"), np.asarray(logprobs, "<f4"), np.asarray(ids, "<i4")]
    head = _HEADER.pack(MAGIC, rows, length, k, temperature)
    return head + b"".join(p.tobytes() for p in parts)


def decode_response(body: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(echoed tokens [R, L] int32, log-probs [R, L, k] float32, ids [R, L, k] int32, T)."""
    rows, length, k, temperature = _header(body)
    shapes = [
        ("int32", (rows, length)),
        ("float32", (rows, length, k)),
        ("int32", (rows, length, k)),
    ]
    tokens, logprobs, ids = _arrays(body, shapes)
    return tokens, logprobs, ids, temperature
