"""`distill bench --on-policy`: the on-policy step's parts alone, then pipelined.

Generation (the student's sampler on the training mesh, `distill.on_policy` lengths), the
teacher scoring the rows it makes, and the student's step on them are each timed alone
(medians after a warm-up, round-robin as `pipelines.bench.phases` does); then the real local loop
runs fully on-policy (`distill.on_policy.fraction` 1, `pipeline.max_staleness` as
configured) and its step time is compared with the sum of the three parts: on one host's
CPU, where the meshes share the cores, the pipelined step should cost no more than the
parts run back to back.
"""

from __future__ import annotations

import tempfile

import jax

from distill.config import Config
from distill.data.corpus import Corpus
from distill.data.tokenizers import vocab_limit
from distill.mesh import Meshes
from distill.models import decode
from pipelines.bench.phases import _interleaved_ms, _pipelined_ms, _teacher_params
from student import optim, train
from student.generate import sampler_for
from student.remat import concrete as concrete_remat
from teacher.forward import make_output_forward
from teacher.sharding import batch_sharding


def _on_policy_config(cfg: Config) -> Config:
    ocfg = cfg.model_copy(deep=True)
    ocfg.distill.on_policy.fraction = 1.0
    ocfg.pipeline.prefetch = min(ocfg.pipeline.prefetch, ocfg.pipeline.max_staleness + 1)
    return ocfg


def bench_on_policy(cfg: Config, corpus: Corpus, meshes: Meshes, repeats: int = 10) -> dict:
    """generate_ms, gen_tokens_per_s, score_ms, student_on_policy_ms, the pipelined
    on_policy_pipeline_ms and its ratio to the sum of the parts."""
    cfg = _on_policy_config(cfg)
    with tempfile.TemporaryDirectory(prefix="distill-bench-op-") as tmp:
        res = _parts_ms(cfg, corpus, meshes, tmp, repeats)
        res["on_policy_pipeline_ms"], _, _ = _pipelined_ms(
            cfg, corpus, meshes, f"{tmp}/run", repeats
        )
    parts = res["generate_ms"] + res["score_ms"] + res["student_on_policy_ms"]
    res["on_policy_over_sum"] = res["on_policy_pipeline_ms"] / parts
    res["on_policy_staleness"] = cfg.pipeline.max_staleness
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}


def _parts_ms(cfg: Config, corpus: Corpus, meshes: Meshes, tmp: str, repeats: int) -> dict:
    limit = vocab_limit(corpus.tokenizer, *cfg.vocab_sizes())
    scfg = cfg.student_model()
    t_params = _teacher_params(cfg, meshes, tmp)
    prompt_len, _ = cfg.distill.on_policy.lengths(cfg.train.seq_len)
    batch = next(corpus.train_iterator(cfg.train.batch_size, seed=cfg.run.seed))
    prompts = decode.prompts_of(batch, prompt_len)
    sampler = sampler_for(cfg, meshes.student, corpus.tokenizer, limit)
    tx = optim.make_optimizer(cfg.optim, 10**6)
    box = [train.init_state(scfg, tx, cfg.run.seed, meshes.student)]
    key = jax.random.key(cfg.run.seed)
    rows, stats = sampler(box[0].params, prompts, key)
    count = stats["tokens"]
    score = make_output_forward(cfg, meshes.teacher, limit)
    t_put = batch_sharding(meshes.teacher)
    t_out = jax.device_put(
        score(t_params, jax.device_put(rows, t_put)), train.batch_sharding(meshes.student)
    )
    step = train.make_train_step(
        scfg, tx, meshes.student, loss_cfg=cfg.distill,
        lr_schedule=optim.schedule(cfg.optim, 10**6), dtype=cfg.student.dtype,
        vocab_limit=limit, remat=concrete_remat(cfg.train.remat, meshes.platform),
        grad_accum=cfg.train.grad_accum,
        layer_loop=cfg.train.layer_loop,
    )  # fmt: skip

    def student():
        box[0], metrics = step(box[0], rows, t_out)
        return metrics

    res = _interleaved_ms(
        {
            "generate_ms": lambda: sampler(box[0].params, prompts, key),
            "score_ms": lambda: score(t_params, jax.device_put(rows, t_put)),
            "student_on_policy_ms": student,
        },
        repeats,
    )
    res["generated_tokens"] = int(count)
    res["gen_tokens_per_s"] = int(count) / (res["generate_ms"] / 1e3)
    return res


def format_on_policy(r: dict) -> str:
    return (
        f"on-policy: generate {r['generate_ms']:.1f} ms ({r['gen_tokens_per_s']:.0f} generated "
        f"tok/s), teacher scoring {r['score_ms']:.1f} ms, student step "
        f"{r['student_on_policy_ms']:.1f} ms; pipelined {r['on_policy_pipeline_ms']:.1f} ms/step "
        f"= {r['on_policy_over_sum']:.2f}x their sum (max_staleness "
        f"{r['on_policy_staleness']})"
    )
