"""`distill plan`: the device split, sizes and FLOPs, computed from shapes alone (here), and
what the compiled programs say: per-device memory (`memory`), FLOPs per token (`flops`),
and on CPU devices their sum against the machine's RAM (`host_memory`)."""

from __future__ import annotations

import math

from distill.config import Config
from distill.handoff import (
    dense_blocks,
    eval_rows,
    eval_windows,
    student_rows,
    teacher_output_bytes_per_step,
    teacher_output_bytes_per_token,
)
from distill.mesh import CP, EP, Meshes, Placement, student_shape
from distill.models import counts, model, moe
from distill.models.experts import dispatch
from student import optim, sharding, train
from teacher import stages
from teacher.forward import microbatch_rows


def _dtype_bytes(cfg: Config) -> int:
    """Bytes of a teacher weight or activation: as loaded, converted once to the compute
    dtype (`teacher.weights.load_teacher`)."""
    return 2 if cfg.teacher.dtype == "bfloat16" else 4


def expert_params(cfg: Config) -> int:
    """The teacher's routed experts' parameters (every layer's gate, up and down)."""
    layers = _teacher_layers(cfg)
    return sum(math.prod(x.shape) for name, x in layers.items() if name.startswith("we_"))


def _teacher_layers(cfg: Config) -> dict:
    """The teacher's abstract layer weights as its mesh holds them: the one-shape stack
    over pipeline stages (`distill.models.parts.to_union`), else each part's own."""
    return model.abstract_params(cfg.teacher.model, cfg.mesh.teacher.pp > 1)["layers"]


def all_to_all_bytes_per_step(cfg: Config, platform: str | None = None) -> int:
    """Bytes through the expert dispatch's all-to-alls in one step, over every device of
    the inference mesh: per MoE layer and microbatch, each device's rows there and their
    results back in the teacher's dtype, and dropless their int32 local expert ids. Dropless
    (`distill.models.experts.dispatch`, its transport chosen for `platform`, default attention's):
    `ragged`, the routed rows alone; `rounds` (CPU), the [ep, C] buffer of one round,
    SLACK times the rows when the load is balanced (a skewed load takes more rounds). With
    a capacity factor each device's buffer [ep, E/ep * C] (`moe.capacity_slots`)."""
    m, t = cfg.teacher.model, cfg.mesh.teacher
    if not m.n_experts or t.ep == 1:  # ep = 1: no dispatch buffer (`moe.moe_ffn`)
        return 0
    rows = cfg.train.batch_size // (t.dp * t.ep)  # each device's rows (replicated over tp)
    size = microbatch_rows(rows, cfg.teacher.microbatch)
    tokens, k, factor = (
        size * cfg.train.seq_len // t.cp,  # a device's S / cp positions of its rows
        m.experts_per_token,
        cfg.teacher.moe_capacity_factor,
    )
    if factor is None:
        sent, ids = dispatch.rows_per_call(tokens, k, t.ep, dispatch.kind(platform)), 4
    else:  # capacity: the slots at fixed places, no ids
        sent, ids = t.ep * moe.capacity_slots(tokens, k, m.n_experts, t.ep, factor), 0
    per_call = sent * (2 * m.d_model * _dtype_bytes(cfg) + ids)
    return per_call * (rows // size) * sum(m.moe_layers()) * t.dp * t.ep * t.cp * t.tp


def teacher_ring_bytes_per_step(cfg: Config) -> int:
    """Bytes each device of the teacher's `cp` ring sends per step in its attention, an
    estimate from shapes (forward only: `ring_bytes_per_step`'s first term): per layer,
    its rows' S / cp positions of k and v (its tp shard's KV heads, the teacher's dtype)
    and segment ids, cp - 1 times. 0 without cp."""
    m, t = cfg.teacher.model, cfg.mesh.teacher
    if t.cp == 1:
        return 0
    tokens = cfg.train.batch_size // (t.dp * t.ep) * cfg.train.seq_len // t.cp
    kv_heads = max(m.n_kv_heads // t.tp, 1)  # fewer than tp: each shard one, repeated
    kv = tokens * (kv_heads * (m.hd + m.v_dim) * _dtype_bytes(cfg) + 4)  # v: MLA's narrower
    return m.n_layers * (t.cp - 1) * kv


# The layer matrices DeepSeek-V3/R1 and Kimi K2 release in float8 (e4m3, a float32 scale per
# 128 x 128 block); their router, norms, embedding and head stay bfloat16.
FLOAT8_KEYS = (
    "wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "w_gate", "w_up", "w_down",
    "we_gate", "we_up", "we_down", "ws_gate", "ws_up", "ws_down",
)  # fmt: skip
FLOAT8_FAMILIES = ("deepseek_v3", "kimi_k2")


def float8_weight_bytes_per_device(cfg: Config, held_bytes: int) -> int:
    """The teacher's weights per device (`held_bytes`, as `teacher_figures` counts them in
    the held dtype) were its released float8 matrices kept in float8 on the devices
    (dequantized per block inside the matmul, which distill does not do: a planned figure)
    rather than converted: 1 byte a value and 4 per 128 x 128 block in place of the held
    dtype's bytes."""
    t = cfg.mesh.teacher
    layers = _teacher_layers(cfg)
    pad = stages.stacked_layers(cfg.teacher.model.n_layers, t.pp) / cfg.teacher.model.n_layers
    per_device = sum(
        math.prod(x.shape) * pad / (t.tp * t.pp * (t.ep if k.startswith("we_") else 1))
        for k, x in layers.items()
        if k in FLOAT8_KEYS
    )
    return int(held_bytes - per_device * (_dtype_bytes(cfg) - 1 - 4 / 128**2))


def layer_params(cfg: Config) -> int:
    """The teacher's stacked layers' parameters (all but the embedding, final norm, head)."""
    layers = _teacher_layers(cfg)
    return sum(math.prod(x.shape) for x in layers.values())


def routed_bytes_per_step(cfg: Config) -> int:
    """The bytes of the routed rows themselves, there and back, over the inference mesh in
    a step: every token's k assignments in each MoE layer on every device that holds the
    token (its tp group): what the all-to-alls would carry with no padding at all."""
    m, t = cfg.teacher.model, cfg.mesh.teacher
    tokens = cfg.train.batch_size * cfg.train.seq_len * m.experts_per_token * t.tp
    return tokens * sum(m.moe_layers()) * 2 * m.d_model * _dtype_bytes(cfg)


def teacher_figures(cfg: Config) -> dict:
    """The teacher's parameters and weight bytes per device (experts split over ep and tp,
    the rest over tp, the layers over the pp stages too); for a mixture of experts its
    active parameters, the experts' bytes per device and the all-to-all bytes per step; with
    pipeline stages their layers, the bubble and the bytes sent between stages per step."""
    tcfg, t, b = cfg.teacher.model, cfg.mesh.teacher, _dtype_bytes(cfg)
    experts, layers = expert_params(cfg), layer_params(cfg)
    union = t.pp > 1
    top = counts.stored_param_count(tcfg, union) - layers  # the embedding, final norm, head
    # the layers as stored (over pp stages, where layers differ, each holds every part:
    # `counts.unused_param_count`), with the zero layers that pad the stack over pp
    pad = stages.stacked_layers(tcfg.n_layers, t.pp) / tcfg.n_layers
    experts, layers = round(experts * pad), round(layers * pad)
    expert_bytes = experts * b // (t.ep * t.tp * t.pp)
    # the top tensors on every stage; a stage's layers on it alone
    dense = top * b // t.tp + (layers - experts) * b // (t.tp * t.pp)
    figures = {
        "params": counts.param_count(tcfg),
        "weight_bytes_per_device": dense + expert_bytes,
        "forward_flops_per_token": counts.flops_per_token(tcfg, cfg.train.seq_len),
    }
    if t.cp > 1:
        figures["ring_bytes_per_step"] = teacher_ring_bytes_per_step(cfg)
    if tcfg.family in FLOAT8_FAMILIES:
        held = figures["weight_bytes_per_device"]
        figures["float8_weight_bytes_per_device"] = float8_weight_bytes_per_device(cfg, held)
    if counts.unused_param_count(tcfg, union):
        figures["unused_params"] = counts.unused_param_count(tcfg, union)
    if tcfg.n_experts:
        figures.update(
            active_params=counts.active_param_count(tcfg),
            expert_bytes_per_device=expert_bytes,
            all_to_all_bytes_per_step=all_to_all_bytes_per_step(cfg),
            routed_bytes_per_step=routed_bytes_per_step(cfg) if t.ep > 1 else 0,
        )
    if t.pp > 1:
        rows = cfg.train.batch_size // (t.dp * t.ep)
        m = rows // microbatch_rows(rows, cfg.teacher.microbatch)
        figures.update(
            stages=t.pp,
            layers_per_stage=stages.stage_layers(cfg),
            microbatches=m,
            bubble=stages.bubble(t.pp, m),
            stage_bytes_per_step=stages.stage_bytes(cfg, m, b),
        )
    return figures


def ring_bytes_per_step(cfg: Config) -> int:
    """Bytes each device of the student's `cp` ring sends per step in its attention
    (`distill.models.kernels.ring`), an estimate from shapes: per layer, the forward
    passes its rows' k and v (the compute dtype) and segment ids cp - 1 times; the
    backward passes them cp - 1 times again, with float32 dk and dv cp times (under
    `exchange: gather` the same bytes in an all-gather and a reduce-scatter); a
    rematerialised block runs its forward twice. 0 without cp."""
    m, cp = cfg.student_model(), cfg.mesh.student.cp
    if cp == 1:
        return 0
    rows, positions = student_rows(cfg)
    tokens = rows * positions
    dtype = 2 if cfg.student.dtype == "bfloat16" else 4
    kv = tokens * (m.n_kv_heads * (m.hd + m.v_dim) * dtype + 4)  # k, v and segment ids
    forwards = 2 if cfg.train.remat in ("block", "dots") else 1
    dkv = tokens * m.n_kv_heads * (m.hd + m.v_dim) * 4
    return m.n_layers * ((forwards + 1) * (cp - 1) * kv + cp * dkv)


def plan(cfg: Config, meshes: Meshes) -> dict:
    scfg, seq = cfg.student_model(), cfg.train.seq_len
    s_params = counts.param_count(scfg)
    # the student's state as the sharding table lays it out on the training mesh
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps)
    shapes = train.state_shapes(scfg, tx)
    mesh_shape = student_shape(cfg)
    axis = sharding.weight_axes(mesh_shape)
    specs = train.state_specs(scfg, tx, sharding.weight_shards(mesh_shape), axis)
    s_weights = sharding.bytes_per_device(shapes.params, specs.params, mesh_shape)
    opt_bytes = sharding.bytes_per_device(shapes.opt_state, specs.opt_state, mesh_shape)
    k = cfg.teacher.top_k
    return {
        "layout": meshes.layout(),
        "teacher": teacher_figures(cfg),
        "student": {
            "params": s_params,
            "weight_bytes_per_device": s_weights,
            "optimizer_bytes_per_device": opt_bytes,
            "train_flops_per_token": 3 * counts.flops_per_token(scfg, seq),
            **({"active_params": counts.active_param_count(scfg)} if scfg.n_experts else {}),
            **(
                {"ring_bytes_per_step": ring_bytes_per_step(cfg)} if cfg.mesh.student.cp > 1 else {}
            ),
        },
        "tokens_per_step": cfg.train.batch_size * seq,
        "per_device_batch": student_rows(cfg)[0],
        "positions_per_device_row": student_rows(cfg)[1],
        "grad_accum": cfg.train.grad_accum,
        "teacher_output": f"top-{k}" if k else _dense_layout(cfg),
        "bytes_per_token_between_meshes": teacher_output_bytes_per_token(cfg),
        "teacher_output_bytes_per_step": teacher_output_bytes_per_step(cfg),
        "eval": {"rows": eval_rows(cfg), "windows": eval_windows(cfg)},
        **({"teachers": several_teachers(cfg)} if cfg.teachers else {}),
    }


def several_teachers(cfg: Config) -> list[dict]:
    """Each of several teachers' name, source, parameters and weight bytes per device of
    the inference mesh (where every local one is held at once), and the bytes per token its
    output adds between the meshes."""
    return [
        {
            "name": one.teacher.name,
            "source": one.teacher.source,
            "params": counts.param_count(one.teacher.model),
            "weight_bytes_per_device": (
                teacher_figures(one)["weight_bytes_per_device"] if one.teacher.loaded() else 0
            ),
            "bytes_per_token_between_meshes": teacher_output_bytes_per_token(one),
        }
        for one in cfg.each_teacher()
    ]


def _teachers_line(p: dict) -> str:
    """The several teachers' line of the plan, or ''."""
    if "teachers" not in p:
        return ""
    each = ", ".join(
        f"{t['name']} ({t['source']}) {t['params'] / 1e6:.2f}M params "
        f"{t['weight_bytes_per_device'] / 2**20:.1f} MiB/device"
        for t in p["teachers"]
    )
    held = sum(t["weight_bytes_per_device"] for t in p["teachers"])
    between = sum(t["bytes_per_token_between_meshes"] for t in p["teachers"])
    between += 4 * len(p["teachers"])  # each position's weights (`TeacherMix`)
    return (
        f"\nteachers: {each}; held together {held / 2**20:.1f} MiB/device of the inference "
        f"mesh, every teacher's output {between} B/token between meshes"
    )


def _positions(p: dict) -> str:
    """` x N positions each` when the student's rows are split by position (cp)."""
    cp = p["layout"]["student"]["shape"].get(CP, 1)
    return f" x {p['positions_per_device_row']} positions (cp={cp})" if cp > 1 else ""


def _ring(role: dict) -> str:
    """`, cp ring ~N MiB/device/step` for a role whose rows are split over cp."""
    n = role.get("ring_bytes_per_step")
    return "" if n is None else f", cp ring ~{n / 2**20:.1f} MiB/device/step"


def _dense_layout(cfg: Config) -> str:
    n = dense_blocks(cfg)
    return "dense" if n == 1 else f"dense in {n} blocks (one per microbatch, under 2^31 elements)"


def format_plan(p: dict) -> str:
    lay, t, s = p["layout"], p["teacher"], p["student"]
    ids = lambda role: ",".join(str(d["id"]) for d in lay[role]["devices"])  # noqa: E731
    shape = lambda role: " x ".join(  # noqa: E731 (ep shown only for experts)
        f"{a}={n}" for a, n in lay[role]["shape"].items() if a != EP or n > 1
    )
    mb = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    micro = f" in {p['grad_accum']} microbatches" if p["grad_accum"] > 1 else ""
    experts = (
        f" ({t['active_params'] / 1e6:.2f}M active; experts {mb(t['expert_bytes_per_device'])}"
        f"/device, all-to-all {mb(t['all_to_all_bytes_per_step'])}/step for "
        f"{mb(t['routed_bytes_per_step'])} of routed rows)"
        if "active_params" in t
        else ""
    ) + (
        f" (+{t['unused_params'] / 1e6:.2f}M stored unused: over pipeline stages each layer "
        "of the one-shape stack holds both kinds' weights, dense MLP and experts, or "
        "attention and linear attention)"
        if "unused_params" in t
        else ""
    )
    stage_line = (
        f"\nteacher pipeline: {t['stages']} stages x {t['layers_per_stage']} layers, "
        f"{t['microbatches']} microbatches, bubble {t['bubble']:.1%}, "
        f"{mb(t['stage_bytes_per_step'])}/step between stages"
        if "stages" in t
        else ""
    )
    return "\n".join(
        [
            f"devices ({lay['platform']}, {lay.get('placement', Placement.SPLIT)}): "
            f"teacher {shape('teacher')} on [{ids('teacher')}]  |  "
            f"student {shape('student')} on [{ids('student')}]",
            f"teacher: {t['params'] / 1e6:.2f}M params{experts}, "
            f"{mb(t['weight_bytes_per_device'])} weights/device"
            + (
                f" ({mb(t['float8_weight_bytes_per_device'])} were its float8 release kept so)"
                if "float8_weight_bytes_per_device" in t
                else ""
            )
            + ", "
            f"{t['forward_flops_per_token'] / 1e6:.1f} MFLOP/token forward" + _ring(t) + stage_line,
            f"student: {s['params'] / 1e6:.2f}M params"
            + (f" ({s['active_params'] / 1e6:.2f}M active)" if "active_params" in s else "")
            + ", "
            f"{mb(s['weight_bytes_per_device'])} weights + "
            f"{mb(s['optimizer_bytes_per_device'])} optimizer/device, "
            f"{s['train_flops_per_token'] / 1e6:.1f} MFLOP/token train step" + _ring(s),
            f"batch: {p['tokens_per_step']} tokens/step, {p['per_device_batch']} rows/device"
            f"{_positions(p)}{micro}; "
            f"teacher output {p['teacher_output']}, {p['bytes_per_token_between_meshes']} B/token, "
            f"{mb(p['teacher_output_bytes_per_step'])}/step between meshes"
            + _eval(p)
            + _teachers_line(p),
        ]
    )


def _eval(p: dict) -> str:
    """`; evaluation in N position windows` where an eval chunk's logits need them."""
    e = p["eval"]
    return "" if e["windows"] == 1 else (
        f"; evaluation {e['rows']} rows a chunk in {e['windows']} position windows "
        "(dense logits under 2^31 elements)"
    )  # fmt: skip
