"""`distill plan`: the device split, sizes and FLOPs, computed from shapes alone (here), and
what the compiled programs say: per-device memory (`memory`), FLOPs per token (`flops`),
and on CPU devices their sum against the machine's RAM (`host_memory`)."""

from __future__ import annotations

import math

from distill.config import Config
from distill.errors import DistillError
from distill.limits import MAX_ELEMENTS, rows_that_fit
from distill.mesh import (
    CP,
    EP,
    Meshes,
    student_row_shards,
    student_shape,
    student_size,
    teacher_size,
)
from distill.models import model, moe
from distill.models.experts import dispatch
from pipelines.evaluation import eval_rows, eval_windows
from student import optim, sharding, train
from teacher import pipeline
from teacher.forward import microbatch_rows

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


def _dense_elements(cfg: Config, blocks: int, teacher_len: int | None) -> tuple[int, int, int]:
    """(rows, positions, elements) of one device's array of a dense output in `blocks`."""
    s = max(cfg.train.seq_len, teacher_len or 0)
    rows = dense_rows_per_device(cfg, cfg.train.batch_size // blocks)
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


def _dtype_bytes(cfg: Config) -> int:
    """Bytes of a teacher weight or activation: as loaded, converted once to the compute
    dtype (`teacher.weights.load_teacher`)."""
    return 2 if cfg.teacher.dtype == "bfloat16" else 4


def expert_params(cfg: Config) -> int:
    """The teacher's routed experts' parameters (every layer's gate, up and down)."""
    layers = model.abstract_params(cfg.teacher.model)["layers"]
    return sum(math.prod(x.shape) for name, x in layers.items() if name.startswith("we_"))


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
    layers = model.abstract_params(cfg.teacher.model)["layers"]
    pad = pipeline.stacked_layers(cfg.teacher.model.n_layers, t.pp) / cfg.teacher.model.n_layers
    per_device = sum(
        math.prod(x.shape) * pad / (t.tp * t.pp * (t.ep if k.startswith("we_") else 1))
        for k, x in layers.items()
        if k in FLOAT8_KEYS
    )
    return int(held_bytes - per_device * (_dtype_bytes(cfg) - 1 - 4 / 128**2))


def layer_params(cfg: Config) -> int:
    """The teacher's stacked layers' parameters (all but the embedding, final norm, head)."""
    layers = model.abstract_params(cfg.teacher.model)["layers"]
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
    top = model.stored_param_count(tcfg) - layers  # the embedding, final norm and head
    # the layers as stored (where dense and MoE layers mix each holds both:
    # `model.unused_param_count`), with the zero layers that pad the stack over pp
    pad = pipeline.stacked_layers(tcfg.n_layers, t.pp) / tcfg.n_layers
    experts, layers = round(experts * pad), round(layers * pad)
    expert_bytes = experts * b // (t.ep * t.tp * t.pp)
    # the top tensors on every stage; a stage's layers on it alone
    dense = top * b // t.tp + (layers - experts) * b // (t.tp * t.pp)
    figures = {
        "params": model.param_count(tcfg),
        "weight_bytes_per_device": dense + expert_bytes,
        "forward_flops_per_token": model.flops_per_token(tcfg, cfg.train.seq_len),
    }
    if t.cp > 1:
        figures["ring_bytes_per_step"] = teacher_ring_bytes_per_step(cfg)
    if tcfg.family in FLOAT8_FAMILIES:
        held = figures["weight_bytes_per_device"]
        figures["float8_weight_bytes_per_device"] = float8_weight_bytes_per_device(cfg, held)
    if tcfg.mixed_ffn():
        figures["unused_params"] = model.unused_param_count(tcfg)
    if tcfg.n_experts:
        figures.update(
            active_params=model.active_param_count(tcfg),
            expert_bytes_per_device=expert_bytes,
            all_to_all_bytes_per_step=all_to_all_bytes_per_step(cfg),
            routed_bytes_per_step=routed_bytes_per_step(cfg) if t.ep > 1 else 0,
        )
    if t.pp > 1:
        rows = cfg.train.batch_size // (t.dp * t.ep)
        m = rows // microbatch_rows(rows, cfg.teacher.microbatch)
        figures.update(
            stages=t.pp,
            layers_per_stage=pipeline.stage_layers(cfg),
            microbatches=m,
            bubble=pipeline.bubble(t.pp, m),
            stage_bytes_per_step=pipeline.stage_bytes(cfg, m, b),
        )
    return figures


def ring_bytes_per_step(cfg: Config) -> int:
    """Bytes each device of the student's `cp` ring sends per step in its attention
    (`distill.models.ring_attention`), an estimate from shapes: per layer, the forward
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
    s_params = model.param_count(scfg)
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
            "train_flops_per_token": 3 * model.flops_per_token(scfg, seq),
            **({"active_params": model.active_param_count(scfg)} if scfg.n_experts else {}),
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
    }


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
        f" (+{t['unused_params'] / 1e6:.2f}M stored unused: each layer holds both the dense "
        "MLP and the experts)"
        if "unused_params" in t
        else ""
    )
    stages = (
        f"\nteacher pipeline: {t['stages']} stages x {t['layers_per_stage']} layers, "
        f"{t['microbatches']} microbatches, bubble {t['bubble']:.1%}, "
        f"{mb(t['stage_bytes_per_step'])}/step between stages"
        if "stages" in t
        else ""
    )
    return "\n".join(
        [
            f"devices ({lay['platform']}, {lay.get('placement', 'split')}): "
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
            f"{t['forward_flops_per_token'] / 1e6:.1f} MFLOP/token forward" + _ring(t) + stages,
            f"student: {s['params'] / 1e6:.2f}M params"
            + (f" ({s['active_params'] / 1e6:.2f}M active)" if "active_params" in s else "")
            + ", "
            f"{mb(s['weight_bytes_per_device'])} weights + "
            f"{mb(s['optimizer_bytes_per_device'])} optimizer/device, "
            f"{s['train_flops_per_token'] / 1e6:.1f} MFLOP/token train step" + _ring(s),
            f"batch: {p['tokens_per_step']} tokens/step, {p['per_device_batch']} rows/device"
            f"{_positions(p)}{micro}; "
            f"teacher output {p['teacher_output']}, {p['bytes_per_token_between_meshes']} B/token, "
            f"{mb(p['teacher_output_bytes_per_step'])}/step between meshes" + _eval(p),
        ]
    )


def _eval(p: dict) -> str:
    """`; evaluation in N position windows` where an eval chunk's logits need them."""
    e = p["eval"]
    return "" if e["windows"] == 1 else (
        f"; evaluation {e['rows']} rows a chunk in {e['windows']} position windows "
        "(dense logits under 2^31 elements)"
    )  # fmt: skip
