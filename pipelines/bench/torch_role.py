"""`distill bench --role teacher|student --torch`: one role as a user would write it in
PyTorch + transformers, on the same shapes, for distill's figures to be compared with.

The device is torch's `cuda:0` where CUDA is available, else the CPU (every core the OS
reports: `torch_ref.cpu_threads`); the models are random transformers models of the role's
family and shape (`torch_ref.hf_model`, from the config.json distill exports); a batch is
`train.batch_size` rows of `train.seq_len` random ids with a target at every position
(`torch_ref.random_ids`). `teacher.dtype` / `student.dtype` `auto` resolve by torch's device
as distill's resolve by JAX's (bfloat16 on an accelerator, float32 on the CPU).

- teacher: the model held in the teacher dtype, under `torch.no_grad()`, `teacher.microbatch`
  rows at a time (the largest divisor of the batch not above it, as distill's forward); of
  each, log softmax(z / T) over the live ids (padded ids -inf) and `torch.topk` of
  `teacher.top_k` (dense log-probs when it is null), as distill's teacher output.
- student: float32 master weights under bfloat16 autocast when `student.dtype` is bfloat16,
  gradient checkpointing unless `train.remat: none`, `train.grad_accum` microbatches (rows
  j, j + n, ... as distill's, each loss weighted by its share of the tokens), gradient
  clipping (`optim.clip_norm`), AdamW (fused on CUDA) and `zero_grad(set_to_none=True)`.
  Its loss is distill's (`distill.models.losses.kd_loss`: `distill.loss`, alpha, T, the
  top-k's k + 1 buckets with the tail), from random teacher outputs of the configured kind.

Figures: the median step (`torch_ref.median_step_ms`, the device synchronised per window),
tokens/s, and the peak memory torch allocated on a CUDA device (None on the CPU, where a
process-wide figure would count distill's arrays too).

The peer runs before JAX starts on the device (`pipelines.bench.role.bench_role`), and its
cached memory is handed back afterwards: JAX preallocates most of a GPU as it starts, which
would leave a later peer too little.
"""

from __future__ import annotations

import gc
import math

from distill.config import Config, DistillLossConfig
from distill.data.tokenizers import build_tokenizer, vocab_limit
from distill.models.losses import PADDED_LOGIT, TAIL_FLOOR
from pipelines.bench.torch_ref import (
    adamw,
    cpu_threads,
    hf_model,
    median_step_ms,
    modules,
    random_ids,
)


def torch_role_bench(cfg: Config, role: str, repeats: int) -> dict:
    """The peer's figures for `role` (module docstring): torch_{role}_ms,
    torch_{role}_tokens_per_s, torch_peak_bytes (None on the CPU), torch_device,
    torch_threads (None on CUDA), torch_version."""
    torch, transformers = modules()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    cfg = cfg.model_copy(deep=True)
    cfg.resolve_dtypes(device.type)  # "cpu" -> float32, else bfloat16, as distill's
    live = vocab_limit(build_tokenizer(cfg.data), *cfg.vocab_sizes())
    with cpu_threads(torch) as threads:
        ms, peak = _measure(torch, transformers, cfg, role, live, device, repeats)
    if cuda:  # the models and outputs went with `_measure` (and any cycles now): hand back
        gc.collect()
        torch.cuda.empty_cache()
    tokens = cfg.train.batch_size * cfg.train.seq_len
    return {
        f"torch_{role}_ms": ms,
        f"torch_{role}_tokens_per_s": tokens / (ms / 1e3),
        "torch_peak_bytes": peak,
        "torch_device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch_threads": None if cuda else threads,
        "torch_version": torch.__version__,
    }


def _measure(torch, transformers, cfg: Config, role: str, live, device, repeats: int):
    """(median ms, peak CUDA bytes or None) of the role's peer step on `device`."""
    cuda = device.type == "cuda"
    torch.manual_seed(cfg.run.seed)
    ids = random_ids(torch, cfg, live, device)
    seq = cfg.train.seq_len
    if role == "teacher":
        dtype = torch.bfloat16 if cfg.teacher.dtype == "bfloat16" else torch.float32
        model = hf_model(transformers, cfg.teacher.model, seq, dtype=dtype, device=device)
        step = teacher_peer(torch, cfg, model.eval(), live, ids[:, :-1])
    else:
        model = hf_model(transformers, cfg.student_model(), seq, device=device)
        out = random_teacher_out(torch, cfg, live, device)
        mask = torch.ones(ids[:, 1:].shape, device=device)
        step = student_peer(torch, cfg, model.train(), live, ids[:, :-1], ids[:, 1:], mask, out)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    ms = median_step_ms(step, repeats, torch.cuda.synchronize if cuda else None)
    return ms, torch.cuda.max_memory_allocated(device) if cuda else None


def _masked(torch, z, live: int | None, fill: float):
    """`z` [..., V] with `fill` at ids >= `live` (a model vocabulary padded past its
    tokenizer's), as `distill.collectives.mask_vocab`."""
    if live is None or live >= z.shape[-1]:
        return z
    return z.masked_fill(torch.arange(z.shape[-1], device=z.device) >= live, fill)


def teacher_logprobs(torch, logits, live: int | None, temperature: float):
    """log softmax(z / T) in float32 over the live ids, padded ids -inf."""
    z = _masked(torch, logits.float() / temperature, live, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def teacher_peer(torch, cfg: Config, model, live: int | None, tokens):
    """forward() -> (log-probs, ids): the teacher output of `tokens` [B, S] as distill's
    teacher gives it (top-k values and int64 ids [B, S, k], or dense log-probs [B, S, V]
    and None), `teacher.microbatch` rows at a time under `torch.no_grad()`."""
    rows = tokens.shape[0]
    mb = max(
        d for d in range(1, rows + 1) if rows % d == 0 and d <= (cfg.teacher.microbatch or rows)
    )
    k, temp = cfg.teacher.top_k, cfg.distill.temperature

    @torch.no_grad()
    def forward():
        parts = []
        for chunk in tokens.split(mb):
            lp = teacher_logprobs(torch, model(input_ids=chunk).logits, live, temp)
            parts.append(torch.topk(lp, k, dim=-1) if k else (lp, None))
        lps, ids = zip(*parts, strict=True)
        return torch.cat(lps), None if k is None else torch.cat(ids)

    return forward


def random_teacher_out(torch, cfg: Config, live: int | None, device):
    """A teacher output of the configured kind for the student's vocabulary, from random
    logits, a row at a time (no [B, S, V] logits whole): (top-k log-probs, ids) or (dense
    log-probs, None), as `pipelines.bench.role.random_outputs`."""
    v, k = cfg.student_model().vocab_size, cfg.teacher.top_k
    gen = torch.Generator(device).manual_seed(cfg.run.seed)
    parts = []
    for _ in range(cfg.train.batch_size):
        z = 2.0 * torch.randn((1, cfg.train.seq_len, v), generator=gen, device=device)
        lp = teacher_logprobs(torch, z, live, cfg.distill.temperature)
        parts.append(torch.topk(lp, k, dim=-1) if k else (lp, None))
    lps, ids = zip(*parts, strict=True)
    return torch.cat(lps), None if k is None else torch.cat(ids)


def student_peer(torch, cfg: Config, model, live, tokens, targets, mask, teacher_out):
    """step() -> the step's loss (before its update): one training step of `model` on the
    fixed batch and teacher output (module docstring)."""
    device = tokens.device
    opt = adamw(torch, model, cfg.optim, fused=device.type == "cuda")
    if cfg.train.remat != "none":  # transformers 5.24 renamed it; older ones know the old name
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    n, clip = cfg.train.grad_accum, cfg.optim.clip_norm
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=cfg.student.dtype == "bfloat16")
    total = mask.sum().clamp(min=1.0)
    lp, ids = teacher_out

    def step():
        loss = torch.zeros((), device=device)
        for j in range(n):  # microbatch j: rows j, j + n, ... (`student.train._accumulate`)
            with autocast:
                logits = model(input_ids=tokens[j::n]).logits
            out = (lp[j::n], None if ids is None else ids[j::n])
            part = kd_loss(torch, logits, out, targets[j::n], mask[j::n], cfg.distill, live)
            part = part * mask[j::n].sum() / total
            part.backward()
            loss += part.detach()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def kd_loss(torch, student_logits, teacher_out, targets, mask, lcfg: DistillLossConfig, live):
    """distill's loss (`distill.models.losses.kd_loss`) in torch: alpha * T^2 * the masked mean
    of the divergence (over the top-k's k + 1 buckets, or dense) + (1 - alpha) * the masked
    mean of the cross-entropy. Logits [B, S, V], teacher_out (log-probs, ids or None),
    targets [B, S] int64, mask [B, S] float; a float32 scalar tensor."""
    z = _masked(torch, student_logits.float(), live, PADDED_LOGIT)
    zt = z / lcfg.temperature
    lse = torch.logsumexp(zt, dim=-1)
    lq = zt - lse[..., None]
    lp, ids = teacher_out[0].float(), teacher_out[1]
    if ids is not None and ids.shape[-1] < z.shape[-1]:
        in_topk = torch.zeros(zt.shape, dtype=torch.bool, device=zt.device).scatter(-1, ids, True)
        lq_tail = torch.logsumexp(zt.masked_fill(in_topk, float("-inf")), dim=-1) - lse
        if ids.shape[-1] >= min(live or z.shape[-1], z.shape[-1]):  # every live id in the top-k
            lp_tail = torch.full_like(lq_tail, float("-inf"))
        else:
            p_tail = -torch.expm1(torch.logsumexp(lp, dim=-1))
            lp_tail = torch.log(p_tail.clamp(min=TAIL_FLOOR))
        lp = torch.cat([lp, lp_tail[..., None]], dim=-1)
        lq = torch.cat([lq.gather(-1, ids), lq_tail[..., None]], dim=-1)
    elif ids is not None:  # k == V: a permutation of the vocabulary
        lq = lq.gather(-1, ids)
    div = _divergence(torch, lp, lq, lcfg)
    ce = torch.logsumexp(z, dim=-1) - z.gather(-1, targets[..., None])[..., 0]
    kd, ce = _masked_mean(torch, div, mask), _masked_mean(torch, ce, mask)
    return lcfg.alpha * lcfg.temperature**2 * kd + (1.0 - lcfg.alpha) * ce


def _masked_mean(torch, x, mask):
    mask = mask.float()
    return torch.where(mask > 0, x * mask, 0.0).sum() / mask.sum().clamp(min=1.0)


def _kl(torch, la, lb):
    """KL(a || b) over the last axis from log-probs, 0 log 0 = 0 (NaN-free gradients)."""
    a = la.exp()
    live = a > 0
    diff = torch.where(live, la - lb, 0.0)
    return torch.where(live, a * diff, 0.0).sum(-1)


def _divergence(torch, lp, lq, lcfg: DistillLossConfig):
    if lcfg.loss == "forward_kl":
        return _kl(torch, lp, lq)
    if lcfg.loss == "reverse_kl":
        return _kl(torch, lq, lp)
    beta = lcfg.beta
    lm = torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))
    return beta * _kl(torch, lp, lm) + (1.0 - beta) * _kl(torch, lq, lm)
