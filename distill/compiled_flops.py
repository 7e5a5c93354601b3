"""The matmul FLOPs of a compiled XLA program, every loop counted by its trip count.

XLA's cost analysis (`Compiled.cost_analysis()["flops"]`) counts a `while` body once,
whatever its trip count: a model whose layers are one `jax.lax.scan` is counted as one
layer, and a grouped matmul that loops over row tiles as one tile. `dot_flops` reads the
optimised HLO text instead: each `dot` is 2 x its result's elements x its contracted
size, and a computation's count is multiplied by the trip count XLA proved for each loop
that runs it (`known_trip_count` in the while's backend config). Branches of a
`conditional` count as the costliest one. Only dots (the matmuls) are counted: the
elementwise work is small beside them and not what the checks are about. A loop whose trip
count XLA cannot prove (one bounded by the data, as blockwise causal attention's loop over
the key blocks before each query block) is counted once; `dot_counts` says how much of the
total that part is.
"""

from __future__ import annotations

import math
import re

_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (\w[\w\-]*)\((.*)")
_CALLEE = re.compile(r"(calls|to_apply|body)=%([\w.\-]+)")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}"
    r"|true_computation=%([\w.\-]+), false_computation=%([\w.\-]+))"
)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _dims(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines by name, and the entry's name."""
    comps, entry, name = {}, None, None
    for line in hlo.splitlines():
        head = _HEADER.match(line)
        if head:
            name = head.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif line.strip() == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _dot(line: str, shapes: dict[str, list[int]], result: list[int]) -> int:
    lhs = re.match(r"\s*(?:\w+\[[\d,]*\]\S* )?%([\w.\-]+)", line.split(" dot(", 1)[1]).group(1)
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    size = math.prod(shapes[lhs][i] for i in _dims(contracting.group(1))) if contracting else 1
    return 2 * math.prod(result) * size


def dot_flops(hlo: str) -> int:
    """The dot FLOPs of an optimised HLO module (`Compiled.as_text()`), each loop's body
    times its known trip count (1 where XLA knows none)."""
    return dot_counts(hlo)[0]


def dot_counts(hlo: str) -> tuple[int, int]:
    """(`dot_flops`, the part of it inside loops whose trip count XLA does not know, each
    counted once): a loop bounded by data, such as blockwise causal attention's loop over
    the key blocks before each query block, makes the total a lower bound."""
    comps, entry = _computations(hlo)
    memo: dict[str, tuple[int, int]] = {}

    def count(name: str) -> tuple[int, int]:
        if name in memo:
            return memo[name]
        shapes, total, once = {}, 0, 0
        for line in comps.get(name, []):
            d = _DEF.match(line)
            if d:
                shapes[d.group(1)] = _dims(d.group(3))
                if d.group(4) == "dot":
                    total += _dot(line, shapes, shapes[d.group(1)])
            trips = _TRIPS.search(line)
            for kind, callee in _CALLEE.findall(line):
                n = int(trips.group(1)) if kind == "body" and trips else 1
                sub, sub_once = count(callee)
                total += sub * n
                once += sub if kind == "body" and not trips else sub_once * n
            for listed, true, false in _BRANCHES.findall(line):
                names = re.findall(r"%([\w.\-]+)", listed) if listed else [true, false]
                total_once = max(count(n) for n in names)
                total, once = total + total_once[0], once + total_once[1]
        memo[name] = total, once
        return total, once

    return count(entry)


def compiled_dot_flops(compiled) -> int:
    """`dot_flops` of a `jax.stages.Compiled`."""
    return dot_flops(compiled.as_text())


def compiled_dot_counts(compiled) -> tuple[int, int]:
    """`dot_counts` of a `jax.stages.Compiled`."""
    return dot_counts(compiled.as_text())
