"""The programs a process has built, shared by the runs it makes.

Every run builds its programs from its config: the teacher's forward, the student's step,
its evaluation, its sampler, the jitted initialisation of its state. `jax.jit` keeps traces
and executables per function object, and each build makes a new one, so a process that
makes several runs (the test suite, a notebook, `distill bench` after a run) would trace,
lower and compile an equal program again for each of them (seconds per program on CPU
even at test sizes). `cached(build, *args, **kwargs)` returns what an earlier call of `build`
with equal arguments returned, and that function's own cache then skips the work.

Arguments must name everything the program closes over. Config sections (pydantic models)
compare by value; anything else by `==` and `hash` (a mesh compares by its devices and
axes). Attention's platform (`distill.models.attention.use_platform`) is part of every key: the
backends a program lowers to depend on it. At most `MAX_PROGRAMS` are kept, least recently
used first out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from distill.models import attention

MAX_PROGRAMS = 64
T = TypeVar("T")

_built: OrderedDict = OrderedDict()
_lock = threading.RLock()  # a build may build others


def frozen(value):
    """`value` as a hashable key: config sections by their JSON, sequences and mappings
    element by element."""
    if isinstance(value, BaseModel):
        return (type(value).__qualname__, value.model_dump_json())
    if isinstance(value, list | tuple):
        return tuple(frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, frozen(v)) for k, v in value.items()))
    return value


def cached(build: Callable[..., T], *args, **kwargs) -> T:
    """build(*args, **kwargs), or what an earlier call with equal arguments returned."""
    key = (build, attention.platform(), frozen(args), frozen(kwargs))
    with _lock:
        if key in _built:
            _built.move_to_end(key)
            return _built[key]
        value = _built[key] = build(*args, **kwargs)
        if len(_built) > MAX_PROGRAMS:
            _built.popitem(last=False)
        return value


def clear() -> None:
    """Forget every program (their executables are freed with the last reference)."""
    with _lock:
        _built.clear()
