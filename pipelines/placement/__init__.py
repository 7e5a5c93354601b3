"""`mesh.placement`: split, colocated, and `auto`'s choice between them.

`choice`: the candidate layouts of the devices, the prediction model and the choice from
a table of role costs (deterministic for a table); `costs`: those costs from compiled
programs (or those `distill bench --placement` measured: `pipelines.bench.measured`),
`resolve` (auto applied to a config before its meshes are built) and the memory plan of
colocated meshes.
"""

from pipelines.placement.choice import (
    MARGIN,
    ROOFLINE,
    Layout,
    RoleCost,
    Row,
    candidates,
    choose,
    colocated_bytes,
    configured,
    format_table,
    predict,
    role_layouts,
)
from pipelines.placement.costs import (
    check_colocated_fits,
    colocated_memory,
    compiled_costs,
    format_colocated,
    layers_factor,
    resolve,
    student_cost,
    teacher_cost,
)

__all__ = [
    "MARGIN",
    "ROOFLINE",
    "Layout",
    "RoleCost",
    "Row",
    "candidates",
    "check_colocated_fits",
    "choose",
    "colocated_bytes",
    "colocated_memory",
    "compiled_costs",
    "configured",
    "format_colocated",
    "format_table",
    "layers_factor",
    "predict",
    "resolve",
    "role_layouts",
    "student_cost",
    "teacher_cost",
]
