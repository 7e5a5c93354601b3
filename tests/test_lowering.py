"""Every program of the quick start, lowered for CUDA and TPU on this CPU.

No GPU or TPU is lent to these tests, so this is the evidence, short of running, that a
run of `pipelines/quickstart.yaml` on one GPU or one TPU chip (`mesh.placement: auto`
resolves to colocated, every axis 1, bfloat16) builds programs the target can take: each
program is built by the product's own builders for that platform
(`attention.use_platform`, so `auto` attention is cuDNN flash attention on a CUDA GPU and
the splash kernel on TPU), at the quick start's real shapes, traced and lowered to
StableHLO for the target (`.trace(...).lower(lowering_platforms=...)`), and the text is
checked for what would break there: a `ragged_dot` (XLA:GPU rewrites it densely), a host
callback in a hot program, float64, a collective across devices (one device: every
replica group holds one device; the teacher's tensor-parallel `psum`s over its tp=1 axis
remain, as single-device all-reduces XLA drops). The quick start's 8-device split layout
and the shipped 8B-to-1B's teacher forward and student step (abstract shapes) are lowered
the same way. Two TPU faults this found are tested here too (`attention._splash` inside
the teacher's `shard_map`, `attention.over_rows` for the student's sharded rows).

cuDNN: JAX checks, while tracing, the cuDNN version of the installed CUDA plugin
(`check_cudnn_version`, "cuDNN is not detected" on a CPU-only jaxlib) and the device's
compute capability. Those probes are stubbed (cuDNN 9.10 on a Hopper GPU); the custom
calls `__cudnn$fmha...` then lower with JAX's own shape, layout and mask checks applied.

What this does not prove: lowering is not compiling (XLA:GPU's and XLA:TPU's passes,
cuDNN's plan for these shapes, Mosaic's compilation of the splash kernel) and not running
(memory, numerics, speed). Those need the device (`-m gpu` on a GPU).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from distill import checkpoint
from distill import mesh as mesh_layout
from distill.config.load import load_config
from distill.data.tokenizers import build_tokenizer, vocab_limit
from distill.handoff import eval_rows, eval_windows
from distill.mesh import DP, student_mesh, teacher_mesh
from distill.models import attention
from distill.models.decode import Prompts
from pipelines.placement.costs import resolve
from pipelines.plan.memory import abstract_batch, abstract_teacher_output, teacher_params
from student import eval_programs, train
from student.generate import sampler_for
from teacher import online
from teacher import sharding as teacher_sharding
from teacher.forward import forward_for, make_output_forward

TARGETS = {"gpu": "cuda", "tpu": "tpu"}
KERNEL = {"gpu": r"custom_call @__cudnn\$fmha", "tpu": r"custom_call @tpu_custom_call"}
COLLECTIVE = r'"stablehlo\.(all_reduce|all_gather|all_to_all|reduce_scatter|collective_permute)"'


def stub_gpu_probes(mp: pytest.MonkeyPatch) -> None:
    """A CUDA GPU for what JAX asks of the installed one while tracing (module docstring)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    mp.setattr(fa, "check_cudnn_version", lambda: 91000)
    mp.setattr(fa, "check_compute_capability", lambda capability: True)
    mp.setattr(fa, "is_cuda_compute_capability_equal", lambda capability: False)
    mp.setattr(attention, "_is_cuda", lambda: True)
    mp.setattr(attention, "_cudnn_head_dim_max", lambda: 256)  # Hopper's, as above


def quickstart_on_one(platform: str):
    """The quick start's config resolved as on one `platform` device: `mesh.placement: auto`
    (the product's `resolve`), compute dtypes for the platform. `train.remat: auto` is
    resolved on an accelerator from the compiled peaks (`resolve_remat`), which need the
    device; at these sizes the first candidate, `none`, fits any, so it is set here. The
    layers scan, as `train.layer_loop: auto` does off CPU (the bootstrap's step takes `auto`
    from its mesh's CPU device and unrolls: the same operations, per layer)."""
    cfg = load_config("pipelines/quickstart.yaml")
    resolve(cfg, [SimpleNamespace(platform=platform)])
    assert cfg.mesh.placement == "colocated" and cfg.teacher.dtype == "bfloat16"
    cfg.train.remat, cfg.train.layer_loop = "none", "scan"
    return cfg


def quickstart_programs(cfg) -> dict:
    """{name: (jitted program, abstract arguments)} for every program a quick-start run
    makes on one device, built as the run builds them (`pipelines.bootstrap`,
    `student.executor`, `teacher.online`, `student.evaluate`, `pipelines.on_policy`,
    `distill.checkpoint`). The list is what a 4-step run of the quick start on one CPU
    device compiled (JAX_LOG_COMPILES=1), less JAX's own eager ops (random key seeding,
    dtype conversions, `lax.stage`): a program added to the run must be added here."""
    devices = jax.devices()
    ids_t, ids_s = mesh_layout._device_ids(cfg)  # `build_meshes`' devices, without its probe
    t, s = cfg.mesh.teacher, cfg.mesh.student
    tmesh = teacher_mesh([devices[i] for i in ids_t], t.dp, t.tp, t.ep)
    smesh = student_mesh([devices[i] for i in ids_s], s.dp, s.fsdp)
    every = [devices[i] for i in dict.fromkeys(ids_t + ids_s)]
    boot = Mesh(np.array(every), (DP,))  # `bootstrap._bootstrap_mesh` (the batch divides it)
    tok = build_tokenizer(cfg.data)
    limit = vocab_limit(tok, *cfg.vocab_sizes())
    tcfg, scfg = cfg.teacher.model, cfg.student_model()
    rows = eval_rows(cfg)

    ocfg = cfg.optim.model_copy(update={"lr": cfg.teacher.pretrain_lr})
    btx, boot_step = train.step_for(
        tcfg, ocfg, cfg.teacher.pretrain_steps, boot, loss_cfg=None, dtype=cfg.teacher.dtype,
        with_teacher=False,
    )  # fmt: skip
    progs = {
        "bootstrap init": (train._init_program(tcfg, btx, cfg.run.seed + 1, boot, True), (None,)),
        "bootstrap step": (
            boot_step,
            (
                train.abstract_state(tcfg, btx, boot),
                abstract_batch(cfg, train.batch_sharding(boot)),
            ),
        ),
    }
    params = teacher_params(cfg, tmesh)
    on_teacher = teacher_sharding.batch_sharding(tmesh)
    kw = {"dtype": cfg.teacher.dtype, "vocab_limit": limit, "microbatch": cfg.teacher.microbatch}
    progs["teacher top-k"] = (
        make_output_forward(cfg, tmesh, limit),
        (params, abstract_batch(cfg, on_teacher)),
    )
    eval_rows_t = (params, abstract_batch(cfg, on_teacher, rows))
    progs["teacher eval logits"] = (
        forward_for(tcfg, tmesh, mode="logits", windows=eval_windows(cfg), **kw),
        eval_rows_t,
    )
    progs["teacher target log-probs"] = (
        forward_for(tcfg, tmesh, mode="target_logprobs", **kw),
        eval_rows_t,
    )

    tx, step = train.distill_step_for(cfg, smesh, limit)
    state = train.abstract_state(scfg, tx, smesh)
    split = train.batch_sharding(smesh)
    out = abstract_teacher_output(cfg, split)
    progs["student init"] = (train._init_program(scfg, tx, cfg.run.seed, smesh, True), (None,))
    progs["student step"] = (step, (state, abstract_batch(cfg, split), out))
    logits = jax.ShapeDtypeStruct((rows, cfg.train.seq_len, tcfg.vocab_size), jnp.float32)
    evaluate = eval_programs.eval_fn_for(scfg, smesh, cfg.student.dtype, limit)
    progs["student eval"] = (evaluate, (state.params, abstract_batch(cfg, split, rows), logits))
    sampler = sampler_for(cfg, smesh, tok, limit, temperature=1.0)  # the sample metrics
    prompt_len, _ = cfg.distill.on_policy.lengths(cfg.train.seq_len)
    i32 = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32, sharding=sampler.put)
    key = jax.eval_shape(lambda: jax.random.key(0))
    progs["student samples"] = (sampler._run, (state.params, Prompts(i32, i32, i32), key))
    f32 = jax.ShapeDtypeStruct((rows, cfg.train.seq_len), jnp.float32, sharding=on_teacher)
    progs["teacher sample NLL"] = (
        online._masked_nll,
        (f32, abstract_batch(cfg, on_teacher, rows)),
    )
    progs["checkpoint finite check"] = (checkpoint._all_finite, (state,))
    return progs


_lowered: dict[str, dict[str, str]] = {}


def lowered(cfg, platform: str) -> dict[str, str]:
    """{program: StableHLO text lowered for `platform`'s target} of `quickstart_programs(cfg)`."""
    with pytest.MonkeyPatch.context() as mp:
        stub_gpu_probes(mp)
        mp.setattr(attention, "_platform", platform)
        progs = quickstart_programs(cfg)
        target = (TARGETS[platform],)
        return {
            name: fn.trace(*args).lower(lowering_platforms=target).as_text()
            for name, (fn, args) in progs.items()
        }


def lowered_quickstart(platform: str) -> dict[str, str]:
    """`lowered` for the quick start on one device, built once per session."""
    if platform not in _lowered:
        _lowered[platform] = lowered(quickstart_on_one(platform), platform)
    return _lowered[platform]


def cross_device(text: str) -> list[str]:
    """The collectives of `text` whose replica groups hold more than one device."""
    found = []
    for line in text.splitlines():
        if re.search(COLLECTIVE, line):
            groups = re.search(r"replica_groups = dense<[^>]*> : tensor<(\d+)x(\d+)xi64>", line)
            if groups is None or groups.group(2) != "1":
                found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_the_quick_start_on_one_device_lowers(platform):
    """Every program lowers for the target, with the platform's attention kernel wherever
    a model attends, and none holds a ragged_dot, a host callback, float64 or a collective
    across devices: each is a program of one partition and one replica, so XLA's SPMD
    partitioner has no other device to add communication with either."""
    texts = lowered_quickstart(platform)
    assert len(texts) == 11
    for name, text in texts.items():
        attends = not re.search(r"init|NLL|check", name)
        assert bool(re.search(KERNEL[platform], text)) == attends, name
        assert not re.search(r"(chlo|stablehlo)\.ragged_dot", text), name
        assert "callback" not in text, name
        assert not re.search(r"\bf64\b|xf64>", text), name
        assert cross_device(text) == [], name
        assert "mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 " in text, name
    assert re.search(COLLECTIVE, texts["teacher top-k"])  # the check sees the tp psums


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_the_quick_start_split_over_eight_lowers(platform):
    """A split layout of 8 devices (teacher tp=4 on devices 0-3, student dp=4 on 4-7; the
    bootstrap over all 8): the same programs lower with the platform's attention kernel,
    none holding a ragged_dot, a host callback or float64; the teacher's tensor-parallel
    collectives span its 4 devices."""
    split = ["mesh.placement=split", "mesh.teacher.tp=4", "mesh.student.dp=4"]
    cfg = load_config("pipelines/quickstart.yaml", split)
    cfg.resolve_dtypes(platform)
    cfg.train.remat, cfg.train.layer_loop = "none", "scan"
    texts = lowered(cfg, platform)
    kernel = KERNEL[platform]  # on CUDA, or JAX's partitioning of it over sharded rows
    kernel = f"({kernel}|custom_call @CustomSPMDPartitioning)" if platform == "gpu" else kernel
    for name, text in texts.items():
        if not re.search(r"init|NLL|check", name):
            assert re.search(kernel, text), name
        assert not re.search(r"(chlo|stablehlo)\.ragged_dot", text), name
        assert "callback" not in text, name
        assert not re.search(r"\bf64\b|xf64>", text), name
    assert "tensor<1x4xi64>" in " ".join(cross_device(texts["teacher top-k"]))


def test_cross_device_sees_a_two_device_all_reduce():
    """The collective check can fail: a psum over two devices is found."""
    mesh = Mesh(np.array(jax.devices()[:2]), (DP,))
    f = jax.shard_map(
        lambda x: jax.lax.psum(x, DP), mesh=mesh, in_specs=jax.P(DP), out_specs=jax.P()
    )
    text = jax.jit(f).trace(jnp.zeros(2)).lower(lowering_platforms=("cuda",)).as_text()
    assert len(cross_device(text)) == 1


def test_splash_inside_shard_map_matches_reference():
    """The splash kernel inside `jax.shard_map` (as the teacher's forward calls it), rows
    split over two devices, in Pallas interpret mode: JAX 0.10's kernel declares outputs
    without the axes they vary over, which the shard_map's check refused, so the teacher
    forward failed to trace for TPU; it equals the reference math now."""
    b, s, h, kv, d = 2, 128, 4, 2, 32
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32)
    k, v = (jax.random.normal(x, (b, s, kv, d), jnp.float32) for x in keys[1:])
    seg = jnp.repeat(jnp.array([[1, 2], [1, 1]]), s // 2, axis=1).astype(jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:2]), (DP,))

    def splash(q, k, v, seg):
        return attention.attention(
            q, k, v, seg, backend="splash", block_q=128, block_kv=128, interpret=True
        )

    rows = jax.P(DP)
    got = jax.jit(jax.shard_map(splash, mesh=mesh, in_specs=rows, out_specs=rows))(q, k, v, seg)
    want = attention.attention(q, k, v, seg, backend="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def shipped_8b_to_1b(remat: str) -> dict:
    """{name: (program, abstract arguments)}: the teacher's top-64 forward and the student's
    step of `pipelines/llama3-8b-to-1b.yaml` on its split layout (teacher dp=4 on devices
    0-3, student fsdp=4 on 4-7), bfloat16 as on a GPU, no weights: abstract arrays only."""
    cfg = load_config("pipelines/llama3-8b-to-1b.yaml")
    cfg.resolve_dtypes("gpu")
    cfg.train.remat = remat  # `auto` picks one of these from the GPU's memory
    devices, t, s = jax.devices(), cfg.mesh.teacher, cfg.mesh.student
    tmesh = teacher_mesh(devices[:4], t.dp, t.tp, t.ep)
    smesh = student_mesh(devices[4:8], s.dp, s.fsdp)
    limit = vocab_limit(build_tokenizer(cfg.data), *cfg.vocab_sizes())
    batch = abstract_batch(cfg, teacher_sharding.batch_sharding(tmesh))
    tx, step = train.distill_step_for(cfg, smesh, limit)
    split = train.batch_sharding(smesh)
    state = train.abstract_state(cfg.student_model(), tx, smesh)
    return {
        "teacher top-k": (
            make_output_forward(cfg, tmesh, limit),
            (teacher_params(cfg, tmesh), batch),
        ),
        "student step": (
            step,
            (state, abstract_batch(cfg, split), abstract_teacher_output(cfg, split)),
        ),
    }


@pytest.mark.parametrize("remat", ["none", "dots", "block"])
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_the_shipped_8b_to_1b_lowers(platform, remat, monkeypatch):
    """At 4,096-token rows and a 128,256-id vocabulary: both programs lower for the target
    with its attention kernel, and hold no ragged_dot, host callback or float64, each a
    program of 4 devices. The teacher's explicit collectives are each one device's (tp=1);
    the student's come from the SPMD partitioner, at compile, unseen here. The student's
    attention has its rows split over fsdp: on CUDA, JAX wraps its cuDNN call in
    `custom_partitioning` (`@CustomSPMDPartitioning`: the cuDNN call is made when XLA
    partitions the program); on TPU, the splash kernel, which XLA cannot partition
    ("Mosaic kernels cannot be automatically partitioned"), runs under a `shard_map` over
    the rows (`attention.over_rows`; before it, the student failed to lower for TPU on
    any mesh of more than one device)."""
    stub_gpu_probes(monkeypatch)
    monkeypatch.setattr(attention, "_platform", platform)
    for name, (fn, args) in shipped_8b_to_1b(remat).items():
        text = fn.trace(*args).lower(lowering_platforms=(TARGETS[platform],)).as_text()
        kernel = KERNEL[platform]
        if platform == "gpu" and name.startswith("student"):
            kernel = "custom_call @CustomSPMDPartitioning"
        assert re.search(kernel, text), name
        assert not re.search(r"(chlo|stablehlo)\.ragged_dot", text), name
        assert "callback" not in text, name
        assert not re.search(r"\bf64\b|xf64>", text), name
        assert "mhlo.num_partitions = 4 " in text, name
        assert cross_device(text) == [], name


def test_splash_over_sharded_rows_matches_reference():
    """`attention.over_rows`: splash on rows split over a 2 x 2 mesh (dp x fsdp, as the
    student's), each device its own rows under `jax.shard_map`, in Pallas interpret mode:
    its output and its gradients equal the reference's."""
    b, s, h, kv, d = 4, 128, 4, 2, 32
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32)
    k, v = (jax.random.normal(x, (b, s, kv, d), jnp.float32) for x in keys[1:3])
    probe = jax.random.normal(keys[3], (b, s, h, d))
    seg = jnp.repeat(jnp.array([[1, 2], [1, 1], [3, 3], [1, 2]]), s // 2, axis=1)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "fsdp"))
    rows = jax.sharding.NamedSharding(mesh, jax.P(("dp", "fsdp")))
    splash = attention.over_rows("splash", rows, block_q=128, block_kv=128, interpret=True)
    assert attention.over_rows("blockwise", rows) is None

    def reference(q, k, v, seg):
        return attention.attention(q, k, v, seg, backend="reference")

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v, seg.astype(jnp.int32)) * probe)

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3))
    got = jax.jit(grad, static_argnums=0)(splash, q, k, v)
    want = grad(reference, q, k, v)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qk, v", [(256, 256), (192, 128)], ids=["qwen3.5-gemma", "deepseek-mla"])
def test_wide_heads_lower_to_cudnn_on_hopper(monkeypatch, qk, v):
    """`auto` on a Hopper GPU (the probes stubbed as one) takes cuDNN for 256-wide heads
    and for latent attention's 192-wide queries and keys with 128-wide values, and the
    forward and backward lower for CUDA through JAX's own shape checks to cuDNN's call."""
    stub_gpu_probes(monkeypatch)
    monkeypatch.setattr(attention, "_platform", "gpu")
    assert attention.resolve_backend("auto", jnp.bfloat16, qk) == "cudnn"
    b, s, h = 2, 256, 4
    q = jax.ShapeDtypeStruct((b, s, h, qk), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, s, h, qk), jnp.bfloat16)
    vv = jax.ShapeDtypeStruct((b, s, h, v), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, s), jnp.int32)

    def loss(q, k, v, seg):
        return attention.attention(q, k, v, seg, backend="cudnn").astype(jnp.float32).sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, vv, seg)
    text = text.lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(KERNEL["gpu"], text)) >= 2  # the forward's call and the backward's
