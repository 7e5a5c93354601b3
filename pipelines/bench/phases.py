"""`distill bench`: each phase alone, then the real pipelined loop, in one process.

Every figure is a median over repeats after a warm-up (compilation excluded). The
pipelined step is measured on the real local-mode loop (`pipelines.local.distill_local`)
from its per-step record times, so it includes Grain, transfers, metrics and logging.
MFU follows PaLM appendix B: 3 x forward FLOPs per token (2 x matmul params + attention)
times tokens/s, over the device's bfloat16 peak (on CPU the matmul throughput measured on
the same devices). HFU, beside it, counts the FLOPs the device does: the model's plus what
the step's `train.remat` policy recomputes (`student.remat.train_flops_per_token`, a model
checked against XLA's cost analysis, which counts a scanned loop's body once).
"""

from __future__ import annotations

import logging
import statistics
import subprocess
import sys
import tempfile
import time

import jax

from distill import handoff
from distill.checkpoint import params_exist, save_params
from distill.config import Config, ServerConfig
from distill.data.corpus import Corpus
from distill.data.tokenizers import vocab_limit
from distill.errors import DistillError
from distill.mesh import Meshes
from distill.models import model
from distill.models.cross.losses import CrossSpec
from distill.observability.metrics import MetricsStore
from distill.observability.server import start_server
from distill.outputs import teacher_path
from distill.types import TeacherOutput
from pipelines.bench.figures import student_figures, teacher_figures
from pipelines.local import distill_local
from student import train
from student.executor import cross_spec
from teacher import positions
from teacher import sharding as teacher_sharding
from teacher.forward import make_forward
from teacher.online import own_rows
from teacher.weights import load_teacher

log = logging.getLogger("distill")


def _interleaved_ms(fns: dict, repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median ms of each function, timed round-robin so drift in a shared machine's speed
    hits every variant alike (their ratios are what the targets are about)."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def _teacher_params(cfg: Config, meshes: Meshes, tmp: str):
    """The configured teacher, or a random one of the same shape (speed does not care)."""
    if not params_exist(teacher_path(cfg)):
        path = f"{tmp}/teacher"
        save_params(path, model.init_params(cfg.teacher.model, cfg.run.seed))
        cfg.teacher.checkpoint = path
    return load_teacher(cfg, meshes.teacher)


_LOAD = """
import sys, time, urllib.request
url, n, rate = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
for _ in range(600):  # wait for the server
    try:
        urllib.request.urlopen(url + "healthz", timeout=2); break
    except Exception:
        time.sleep(0.1)
t0 = time.perf_counter()
for i in range(n):
    time.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
    path = "api/status" if i % 2 == 0 else "metrics"
    urllib.request.urlopen(url + path, timeout=10).read()
"""


def _loop_steps(repeats: int) -> tuple[int, int, int]:
    """(warm-up steps, steps per window, total) of a timed loop: a window of warm-up, then
    three timed windows; the loop logs once per window, as runs do every few steps."""
    window = max(repeats, 4)
    return window, window, 4 * window


def _cached_ms(cfg: Config, corpus: Corpus, meshes: Meshes, tmp: str, k: int, repeats: int):
    """Median step time of the local loop training from a teacher cache (`teacher.source:
    cache`, top-`k`), written first by `distill cache-teacher` for as many steps as the
    loop runs. Returns (ms, cache bytes per token on disk)."""
    from pipelines.offline.cache_writer import cache_teacher

    ccfg = cfg.model_copy(deep=True)
    ccfg.teacher.top_k, ccfg.teacher.cache_dir = k, f"{tmp}/cache"
    ccfg.run.output_dir = f"{tmp}/cache-run"
    ccfg.train.steps = _loop_steps(repeats)[2]
    ccfg.data.eval_batches = 1  # as `_pipelined_ms` sets it: the cache must match the loop
    written = cache_teacher(ccfg)
    ccfg.teacher.source = "cache"
    ms, _, _ = _pipelined_ms(ccfg, corpus, meshes, f"{tmp}/cache-run", repeats)
    return ms, written.get("bytes_per_token")


def _pipelined_ms(
    cfg: Config,
    corpus: Corpus,
    meshes: Meshes,
    out_dir: str,
    repeats: int,
    http_requests: int = 0,
    http_rate: float = 0.0,
    mode: str = "local",
) -> tuple[float, float, MetricsStore]:
    """Median step time of the real loop (local or ray mode) over three windows after a
    warm-up, with its status server up; optionally with `http_requests` GETs of /api/status
    and /metrics from a second process, paced at `http_rate` per second.
    Returns (ms, wall seconds, the run's metrics store)."""
    warm, window, steps = _loop_steps(repeats)
    cfg = cfg.model_copy(deep=True)
    cfg.run.output_dir = out_dir
    cfg.train.steps, cfg.train.log_every, cfg.train.metrics_lag = steps, window, 2
    cfg.train.eval_every = cfg.train.checkpoint_every = steps + 1
    cfg.optim.warmup_steps = 1
    cfg.data.eval_batches = 1
    store = MetricsStore(cfg.run.name, steps, {}, output_dir=None)
    server = start_server(store, ServerConfig(port=0))
    load = None
    if http_requests:
        load = subprocess.Popen(
            [sys.executable, "-c", _LOAD, server.url, str(http_requests), str(http_rate)]
        )
    t0 = time.perf_counter()
    try:
        if mode == "ray":
            from pipelines.ray.mode import distill_ray

            distill_ray(cfg, corpus, store)
        else:
            distill_local(cfg, corpus, meshes, store)
    finally:
        wall = time.perf_counter() - t0
        if load is not None:
            load.wait(timeout=600)
        server.stop()
    t = {r["step"]: r["time"] for r in store.history() if "loss" in r and not r.get("eval")}
    windows = [(t[warm + (i + 1) * window] - t[warm + i * window]) / window for i in range(3)]
    return 1e3 * statistics.median(windows), wall, store


def bench(
    cfg: Config,
    corpus: Corpus,
    meshes: Meshes,
    repeats: int = 10,
    http_requests: int = 0,
    ray_mode: bool = False,
    cache_mode: bool = False,
    torch_mode: bool = False,
) -> dict:
    """Every figure of `distill bench`; what it writes (a random teacher when none is
    configured, the loops' checkpoints, a teacher cache) goes to a temporary directory.
    `torch_mode`: also time the plain PyTorch + transformers KD loop on the same shapes
    (`pipelines.bench.torch_ref`)."""
    if cfg.cross_tokenizer() and (ray_mode or cache_mode):
        flag = "--ray" if ray_mode else "--cache"
        raise DistillError(f"{flag}: not supported with teacher.tokenizer of its own yet")
    if torch_mode:
        from pipelines.bench.torch_ref import modules, torch_kd_bench

        modules()  # missing torch fails now, not after the distill figures
    with tempfile.TemporaryDirectory(prefix="distill-bench-") as tmp:
        res = _bench(cfg, corpus, meshes, tmp, repeats, http_requests, ray_mode, cache_mode)
    if torch_mode:
        torch_res = torch_kd_bench(cfg, repeats)
        torch_res["distill_over_torch"] = res["tokens_per_s"] / torch_res["torch_tokens_per_s"]
        res.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in torch_res.items()})
    return res


def _phase_ms(cfg: Config, corpus: Corpus, meshes: Meshes, tmp: str, repeats: int):
    """Each phase alone: the teacher forward (plain, dense, top-k), the student step (CE,
    KD dense, KD top-k) and a Grain batch. Returns (figures, a host batch, top-k used)."""
    bsz = cfg.train.batch_size
    t_params = _teacher_params(cfg, meshes, tmp)
    it = corpus.train_iterator(bsz, seed=cfg.run.seed)
    host_batch = next(it)
    t_put = teacher_sharding.batch_sharding(meshes.teacher)
    t_batch = jax.device_put(own_rows(host_batch), t_put)
    s_put = train.batch_sharding(meshes.student)
    limit = vocab_limit(corpus.tokenizer, *cfg.vocab_sizes())
    res, fwd = teacher_phases_ms(cfg, meshes.teacher, t_params, t_batch, limit, repeats)
    cross = cross_spec(cfg, corpus)  # across tokenizers the step takes dense outputs only
    kinds = ("dense",) if cross is not None else ("dense", "topk")
    outs = {m: fwd[m](t_params, t_batch) for m in kinds}
    if positions.wanted(cfg):  # at the student's positions, as `OnlineTeacher` sends them
        mesh, align = meshes.teacher, host_batch.teacher.align
        outs = {m: positions.at_student_positions(mesh, o, align) for m, o in outs.items()}
    outs = {m: handoff.hop(o, s_put) for m, o in outs.items()}
    s_batch = jax.device_put(host_batch, s_put)
    res.update(student_phases_ms(cfg, meshes.student, s_batch, outs, limit, repeats, cross))

    data_times = []
    for _ in range(repeats * 5):
        t = time.perf_counter()
        next(it)
        data_times.append(time.perf_counter() - t)
    res["data_ms"] = 1e3 * statistics.median(data_times)

    return res, host_batch, bench_top_k(cfg)


def bench_top_k(cfg: Config) -> int:
    """The k of the top-k figures: `teacher.top_k`, or 32 for a dense run."""
    return cfg.teacher.top_k or 32


def teacher_forward(cfg: Config, mesh, limit, mode: str):
    """The teacher forward of `mode` (logits | dense | topk) on `mesh`, as runs build it."""
    return make_forward(
        cfg.teacher.model,
        mesh,
        mode=mode,
        temperature=cfg.distill.temperature,
        top_k=bench_top_k(cfg) if mode == "topk" else None,
        dtype=cfg.teacher.dtype,
        vocab_limit=limit,
        microbatch=cfg.teacher.microbatch,
    )


def teacher_phases_ms(cfg: Config, mesh, params, batch, limit, repeats: int):
    """The teacher forward alone on `mesh`, as runs build it (`teacher.dtype`,
    `teacher.microbatch`): plain logits, dense log-probs and top-k. Returns (figures, the
    forwards by mode)."""
    fwd = {m: teacher_forward(cfg, mesh, limit, m) for m in ("logits", "dense", "topk")}
    res = _interleaved_ms(
        {
            f"teacher_{name}_ms": (lambda m=m: fwd[m](params, batch))
            for name, m in (("plain", "logits"), ("dense", "dense"), ("topk", "topk"))
        },
        repeats,
    )
    return res, fwd


def student_phases_ms(
    cfg: Config, mesh, batch, outs: dict, limit, repeats: int, cross: CrossSpec | None = None
) -> dict:
    """The student step alone on `mesh`, as runs build it (`train.remat`,
    `train.grad_accum`, `student.dtype`): cross-entropy, and KD from each teacher output
    of `outs` ({"dense", "topk"} or a part of it, placed in the student's batch sharding);
    `cross`: the cross-tokenizer comparison, for batches that carry the teacher's rows."""
    steps = {"student_ce_ms": _stepper(cfg, mesh, limit, batch, None, cross)}
    for kind, out in outs.items():
        steps[f"student_kd_{kind}_ms"] = _stepper(cfg, mesh, limit, batch, out, cross)
    if cross is not None:  # the one-vocabulary step of the same student shapes, timed alike
        steps["student_kd_one_vocab_ms"] = _one_vocab_step(cfg, mesh, batch, limit)
    return _interleaved_ms(steps, repeats)


def _one_vocab_step(cfg: Config, mesh, batch, limit):
    """A same-tokenizer KD step of the cross-tokenizer batch's student shapes: the batch
    without the teacher's rows, a dense teacher output [B, S, Vs] in the student's
    vocabulary (values do not change the time)."""
    plain = batch._replace(teacher=None)
    v = cfg.student_model().vocab_size
    logits = jax.random.normal(jax.random.key(0), (*plain.tokens.shape, v))
    out = jax.device_put(TeacherOutput(jax.nn.log_softmax(logits)), train.batch_sharding(mesh))
    return _stepper(cfg, mesh, limit, plain, out)


def _stepper(cfg: Config, mesh, limit, batch, teacher_out, cross: CrossSpec | None = None):
    """one() -> metrics: the run's step on `batch` (and `teacher_out`, or CE without),
    its state carried from call to call."""
    with_teacher = teacher_out is not None
    tx, step = train.distill_step_for(cfg, mesh, limit, with_teacher=with_teacher, cross=cross)
    box = [train.init_state(cfg.student_model(), tx, 0, mesh)]
    extra = () if teacher_out is None else (teacher_out,)

    def one():
        box[0], metrics = step(box[0], batch, *extra)
        return metrics

    return one


def _bench(
    cfg: Config,
    corpus: Corpus,
    meshes: Meshes,
    tmp: str,
    repeats: int,
    http_requests: int,
    ray_mode: bool,
    cache_mode: bool,
) -> dict:
    cfg = cfg.model_copy(deep=True)
    res, host_batch, k = _phase_ms(cfg, corpus, meshes, tmp, repeats)
    _loop_ms(
        res, cfg, corpus, meshes, tmp, repeats, host_batch, k, http_requests, ray_mode, cache_mode
    )
    _derived(res, cfg, meshes)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}


def _loop_ms(
    res, cfg, corpus, meshes, tmp, repeats, host_batch, k, http_requests, ray_mode, cache_mode
):
    """The real pipelined loop: local, and optionally ray mode, offline, and under HTTP load."""
    tokens = cfg.train.batch_size * cfg.train.seq_len
    res["pipeline_ms"], wall, _ = _pipelined_ms(cfg, corpus, meshes, f"{tmp}/run", repeats)
    if ray_mode:
        ray_ms, _, store = _pipelined_ms(cfg, corpus, meshes, f"{tmp}/ray", repeats, mode="ray")
        per_token = [r["bytes_per_token"] for r in store.history() if r.get("bytes_per_token")]
        batch_bytes = sum(x.nbytes for x in host_batch)  # driver -> teacher, driver -> student
        res.update(
            ray_pipeline_ms=ray_ms,
            ray_over_local=ray_ms / res["pipeline_ms"],
            ray_bytes_per_step=int(per_token[-1] * tokens + 2 * batch_bytes),
        )
    if cache_mode:  # offline distillation: the student alone, reading the cache from disk
        cache_ms, cache_bytes = _cached_ms(cfg, corpus, meshes, tmp, k, repeats)
        res.update(
            cache_pipeline_ms=cache_ms,
            cache_over_student=cache_ms / res["student_kd_topk_ms"],
            cache_bytes_per_token=cache_bytes,
        )
    if http_requests:
        loaded, _, _ = _pipelined_ms(
            cfg,
            corpus,
            meshes,
            f"{tmp}/run-http",
            repeats,
            http_requests,
            http_rate=http_requests / wall,
        )
        res["pipeline_http_ms"] = loaded
        res["http_requests"] = http_requests
        res["http_slowdown"] = loaded / res["pipeline_ms"]


def _derived(res: dict, cfg: Config, meshes: Meshes) -> None:
    """Ratios, tokens/s and MFU from the measured figures."""
    tokens = cfg.train.batch_size * cfg.train.seq_len
    res.update(teacher_figures(res, cfg, meshes.teacher))
    res.update(student_figures(res, cfg, meshes.student))
    t, s = res["teacher_ms"], res["student_ms"]
    res.update(
        tokens_per_s=tokens / (res["pipeline_ms"] / 1e3),
        pipeline_over_sum=res["pipeline_ms"] / (t + s),
        pipeline_over_max=res["pipeline_ms"] / max(t, s),
        platform=meshes.platform,
        tokens_per_step=tokens,
    )


def format_bench(r: dict) -> str:
    return "\n".join(
        [
            f"teacher forward: plain {r['teacher_plain_ms']:.1f} ms, dense log-probs "
            f"{r['teacher_dense_ms']:.1f} ms, top-k {r['teacher_topk_ms']:.1f} ms "
            f"({r['topk_over_plain_teacher']:.2f}x plain)",
            f"student step: CE {r['student_ce_ms']:.1f} ms, "
            f"KD dense {r['student_kd_dense_ms']:.1f} ms ({r['kd_over_ce_dense']:.2f}x)"
            + (
                f", KD top-k {r['student_kd_topk_ms']:.1f} ms ({r['kd_over_ce_topk']:.2f}x)"
                if "kd_over_ce_topk" in r
                else f" across tokenizers, {r['cross_over_one_vocab']:.2f}x the one-vocabulary "
                f"KD step of the same shapes ({r['student_kd_one_vocab_ms']:.1f} ms)"
            ),
            f"pipelined step: {r['pipeline_ms']:.1f} ms = {r['pipeline_over_sum']:.2f}x "
            f"(teacher + student), {r['pipeline_over_max']:.2f}x max; "
            f"{r['tokens_per_s']:.0f} tok/s",
            *(
                [
                    f"with {r['http_requests']} HTTP requests: {r['pipeline_http_ms']:.1f} ms/step "
                    f"({r['http_slowdown']:.3f}x)"
                ]
                if "http_slowdown" in r
                else []
            ),
            *(
                [
                    f"ray mode: {r['ray_pipeline_ms']:.1f} ms/step "
                    f"({r['ray_over_local']:.2f}x local), "
                    f"{r['ray_bytes_per_step'] / 2**20:.2f} MiB/step between actors"
                ]
                if "ray_over_local" in r
                else []
            ),
            *(
                [
                    f"offline (teacher cache, top-k): {r['cache_pipeline_ms']:.1f} ms/step "
                    f"({r['cache_over_student']:.2f}x the student-alone top-k step)"
                ]
                if "cache_over_student" in r
                else []
            ),
            *(
                [
                    f"plain PyTorch {r['torch_version']} + transformers KD step (dense, "
                    f"{r['torch_threads']} threads): {r['torch_step_ms']:.1f} ms, "
                    f"{r['torch_tokens_per_s']:.0f} tok/s; distill's pipelined step "
                    f"{r['distill_over_torch']:.2f}x its tokens/s"
                ]
                if "distill_over_torch" in r
                else []
            ),
            f"data: {r['data_ms']:.2f} ms/batch; "
            f"matmul {r['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s; "
            f"MFU: student step {100 * r['mfu']:.1f}% (HFU {100 * r['hfu']:.1f}% with remat "
            f"{r['student_remat']}), teacher forward "
            f"{100 * r['teacher_mfu']:.1f}% ({r['teacher_tokens_per_s']:.0f} tok/s)",
        ]
    )
