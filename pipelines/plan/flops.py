"""The plan's compiled FLOPs: what XLA will run, beside the model's count.

`distill plan` compiles both roles' programs (`pipelines.plan.memory`); from the same
executables `compiled_flops_per_token` is the matmul FLOPs of the program
(`distill.compiled_flops.dot_flops`: every scanned layer, microbatch and tile loop counted
by its trip count, which XLA's own cost analysis does not do) summed over the mesh's
devices and divided by the step's tokens. Beside the model's `forward_flops_per_token`
(teacher) and `train_flops_per_token` (student) it shows what the model figure leaves
out, such as a rematerialised forward, the vocabulary head's padding, the grouped
matmul's padded tiles, or a matmul over every expert where a grouped matmul was meant.

A mixture of experts also names its grouped-matmul kernel (`distill.models.experts.grouped`):
`ragged_dot` on TPU, `mosaic_gpu` (Pallas Mosaic GPU) on Hopper GPUs where its dtype
and block widths allow, `tiled` (exact pure XLA) elsewhere, `batched` for the teacher's
capacity path; and where it dispatches tokens over devices (ep > 1, a student's experts
split over fsdp) the transport (`distill.models.experts.dispatch`): `ragged` on GPU and TPU,
`rounds` on CPU. The tiled kernel skips at run time the tiles no routed row reaches, but a
compiled program holds the worst case of its buffer: at ep > 1 one round's receive buffer
(SLACK = 1.125 times a device's share of a balanced load), the round loop counted once.
"""

from __future__ import annotations

import logging

from distill.compiled_flops import compiled_dot_counts
from distill.config import Config
from distill.errors import DistillError
from distill.models import counts
from distill.models.experts import dispatch, grouped, mosaic
from student.sharding import experts_split

log = logging.getLogger(__name__)


def moe_kernel(cfg: Config, role: str) -> str | None:
    """The grouped-matmul kernel of `role`'s MoE layers; None for a dense model."""
    mcfg = cfg.teacher.model if role == "teacher" else cfg.student_model()
    if not mcfg.n_experts:
        return None
    if role == "teacher" and cfg.teacher.moe_capacity_factor is not None:
        return "batched"
    name = grouped.kernel()
    if name == "mosaic_gpu":  # the Hopper kernels take bfloat16/float16 in 64-wide blocks
        tp = cfg.mesh.teacher.tp if role == "teacher" else 1
        dtype = getattr(cfg, role).dtype
        dtype = "bfloat16" if dtype == "auto" else dtype
        if not mosaic.usable(mcfg.d_model, mcfg.d_ff_expert // tp, dtype):
            return "tiled"
    return name


def moe_dispatch(cfg: Config, role: str) -> str | None:
    """How `role`'s MoE layers send tokens to the devices of their experts: the dropless
    transport (`distill.models.experts.dispatch.kind`: `ragged` on GPU and TPU, `rounds` on CPU),
    `all_to_all` for the teacher's capacity buffers; None where nothing is dispatched
    (ep = 1, a dense model, a student whose experts are gathered, not split)."""
    if role == "teacher":
        if not cfg.teacher.model.n_experts or cfg.mesh.teacher.ep == 1:
            return None
        return "all_to_all" if cfg.teacher.moe_capacity_factor is not None else dispatch.kind()
    return dispatch.kind() if experts_split(cfg.student_model(), cfg.mesh.student.fsdp) else None


def figures(compiled, mesh, cfg: Config, role: str) -> dict:
    """`compiled_flops_per_token` of `role`'s compiled program on `mesh`, and for a mixture
    of experts its `moe_kernel`."""
    tokens = cfg.train.batch_size * cfg.train.seq_len
    total, once = compiled_dot_counts(compiled)
    out = {"compiled_flops_per_token": total * mesh.size / tokens}
    if once:  # a lower bound: loops bounded by data (causal attention's blocks) counted once
        out["compiled_flops_counted_once_per_token"] = once * mesh.size / tokens
    kernel, sent = moe_kernel(cfg, role), moe_dispatch(cfg, role)
    out = out if kernel is None else {**out, "moe_kernel": kernel}
    return out if sent is None else {**out, "moe_dispatch": sent}


def format_flops(p: dict) -> str:
    """One line: each role's compiled FLOPs per token beside its model figure."""
    t, s = p["teacher"], p["student"]
    mf = lambda x: f"{x / 1e6:.1f}"  # noqa: E731
    kernel = lambda r: (  # noqa: E731
        (f", MoE kernel {r['moe_kernel']}" if "moe_kernel" in r else "")
        + (f", dispatch {r['moe_dispatch']}" if "moe_dispatch" in r else "")
    )
    least = lambda r: "at least " if "compiled_flops_counted_once_per_token" in r else ""  # noqa: E731
    line = (
        f"compiled matmuls (XLA, loops times their trip counts): teacher forward {least(t)}"
        f"{mf(t['compiled_flops_per_token'])} MFLOP/token (model {mf(t['forward_flops_per_token'])}"
        f"{kernel(t)}), student step {least(s)}{mf(s['compiled_flops_per_token'])} MFLOP/token "
        f"(model {mf(s['train_flops_per_token'])}{kernel(s)})"
    )
    if least(t) or least(s):
        line += (
            "; at least: loops whose trip count depends on the data (blockwise causal "
            "attention's key blocks) counted once"
        )
    return line


LIMIT = 1.5  # compiled over model FLOPs a teacher MoE forward may reach at ep = 1


def check_moe(cfg: Config, teacher: dict) -> None:
    """One DistillError line when an MoE teacher's compiled forward (`figures`) does over
    `LIMIT` x the model's FLOPs (a grouped matmul rewritten into a matmul over every
    expert: 127x at the 30B-A3B shape); with `teacher.moe_allow_ungrouped` the same line is
    a logged warning. At ep > 1 the compiled figure counts one round's receive buffer
    (module docstring): about 1.25x the active FLOPs of a balanced layer."""
    mcfg = cfg.teacher.model
    if not mcfg.n_experts:
        return
    want = counts.flops_per_token(mcfg, cfg.train.seq_len)
    got = teacher["compiled_flops_per_token"]
    if got <= LIMIT * want:
        return
    line = (
        f"the compiled MoE forward does {got / want:.1f}x the model's {want / 1e9:.2f} "
        f"GFLOP/token (kernel {teacher.get('moe_kernel')}, limit {LIMIT}x): the experts' "
        "matmuls are not grouped on this platform"
    )
    if not cfg.teacher.moe_allow_ungrouped:
        raise DistillError(f"teacher.model: {line}; teacher.moe_allow_ungrouped: true runs it")
    log.warning("teacher.moe_allow_ungrouped: %s", line)
