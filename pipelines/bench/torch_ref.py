"""`distill bench --torch`: the same distillation step as a plain PyTorch + transformers loop,
the baseline distill's tokens/s is compared with.

One step: the teacher's forward under `torch.no_grad()`, the student's forward and backward,
loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) dense over the
vocabulary + (1 - alpha) * CE on the next tokens, gradient clipping (`optim.clip_norm`),
then `torch.optim.AdamW` (`optim.lr` held constant, betas, weight decay on matrices only, as
distill's optimizer) and `zero_grad(set_to_none=True)`. Both models are random
transformers models of their family (`LlamaForCausalLM`, ...) in float32 with SDPA
attention, built from the config.json distill exports (`distill.models.hf.export.
to_hf_config`), so their shapes are the teacher's and the student's.

A batch is `train.batch_size` rows of `train.seq_len` + 1 random token ids (seeded by
`run.seed`) below the tokenizer's vocabulary: the first `seq_len` are the input and the last
`seq_len` the targets, so every position has a target, as on a full packed row of distill's
(one document, every mask 1) and the same tokens per step. Ids past the tokenizer's
vocabulary (a padded model vocabulary) are left out of both softmaxes, as distill masks them.
The divergence is always this dense forward KL, whatever `distill.loss` and `teacher.top_k`
say; distill's pipelined step, which `distill_over_torch` compares it with, follows them.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

from distill.config import Config, ModelConfig, OptimConfig
from distill.data.tokenizers import build_tokenizer, vocab_limit
from distill.errors import DistillError
from distill.models.hf import export as hf_config

WARMUP_STEPS = 3
WINDOW_STEPS = 5


def kd_loss(student_logits, teacher_logits, targets, alpha: float, temperature: float, live=None):
    """alpha * T^2 * KL(p || q) + (1 - alpha) * CE, both means over every token (a full row:
    no masked positions). p = softmax(teacher / T), q = softmax(student / T), over the first
    `live` ids (None: the whole vocabulary); CE of softmax(student) on `targets`.
    Logits [B, S, V], targets [B, S] int64; returns a float32 scalar tensor."""
    import torch.nn.functional as F

    s = student_logits[..., :live].float().flatten(0, -2)
    t = teacher_logits[..., :live].float().flatten(0, -2)
    lq = F.log_softmax(s / temperature, dim=-1)
    lp = F.log_softmax(t / temperature, dim=-1)
    kl = F.kl_div(lq, lp, reduction="batchmean", log_target=True)  # sum p (log p - log q) / N
    ce = F.cross_entropy(s, targets.flatten())
    return alpha * temperature**2 * kl + (1.0 - alpha) * ce


def hf_model(transformers, mcfg: ModelConfig, seq_len: int, *, dtype=None, device=None):
    """A random transformers model of `mcfg`'s family and shape (SDPA attention), made in
    `dtype` (a torch dtype; None: float32) directly on `device` (None: the CPU)."""
    import torch

    raw = hf_config.to_hf_config(mcfg, max_position_embeddings=seq_len)
    config = transformers.AutoConfig.for_model(**raw, use_cache=False)
    with torch.device(device or "cpu"):
        made = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=dtype or torch.float32
        )
    return made


def adamw(torch, model, ocfg: OptimConfig, *, fused: bool = False):
    """AdamW with weight decay on matrices only (norms exempt), as `student.optim`;
    `fused`: torch's fused CUDA kernel."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": ocfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    betas = (ocfg.b1, ocfg.b2)
    return torch.optim.AdamW(groups, lr=ocfg.lr, betas=betas, fused=fused or None)


def modules():
    """(torch, transformers), or DistillError saying how to install them.

    Imported here first, torch's OpenMP threads wait passively (`OMP_WAIT_POLICY=PASSIVE`
    unless set already): with its default spin-waiting, a step on a 2-core machine shared with
    other work measured 2.6-4.2 s on 2 threads against 0.36-0.51 s on 1 thread, and 0.39-0.48
    s on 2 passive threads (libgomp reads the variable once, when torch loads it)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch
        import transformers
    except ImportError:
        raise DistillError(
            "bench --torch: needs torch and transformers: pip install -e '.[hf]'"
        ) from None
    return torch, transformers


def torch_kd_bench(cfg: Config, repeats: int) -> dict:
    """Median step time of the PyTorch KD loop on `cfg`'s shapes (`median_step_ms`), on the
    CPU with every core the OS reports (`cpu_threads`)."""
    torch, transformers = modules()
    bsz, seq = cfg.train.batch_size, cfg.train.seq_len
    live = vocab_limit(build_tokenizer(cfg.data), *cfg.vocab_sizes())
    with cpu_threads(torch) as threads:
        torch.manual_seed(cfg.run.seed)
        teacher = hf_model(transformers, cfg.teacher.model, seq).eval()
        student = hf_model(transformers, cfg.student_model(), seq).train()
        ids = random_ids(torch, cfg, live)
        step = _make_step(torch, cfg, teacher, student, ids[:, :-1], ids[:, 1:], live)
        ms = median_step_ms(step, repeats)
    return {
        "torch_step_ms": ms,
        "torch_tokens_per_s": bsz * seq / (ms / 1e3),
        "torch_threads": threads,
        "torch_version": torch.__version__,
    }


def random_ids(torch, cfg: Config, live: int | None, device=None):
    """[train.batch_size, train.seq_len + 1] random token ids below the tokenizer's
    vocabulary, seeded by `run.seed`: inputs [:, :-1], targets [:, 1:]."""
    gen = torch.Generator().manual_seed(cfg.run.seed)
    shape = (cfg.train.batch_size, cfg.train.seq_len + 1)
    return torch.randint(0, live or cfg.teacher.model.vocab_size, shape, generator=gen).to(device)


@contextlib.contextmanager
def cpu_threads(torch):
    """torch on every core the OS reports (`torch.set_num_threads(os.cpu_count())`; yields
    the count), restored afterwards; their OpenMP wait policy passive when torch was first
    imported by `modules`."""
    threads, before = os.cpu_count() or 1, torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def median_step_ms(step, repeats: int, sync=None) -> float:
    """`step()`'s time in ms: 3 warm-up steps, then `repeats` windows of 5 steps, each
    window's mean step time; the median over windows. `sync()` (a CUDA device's
    synchronize) runs after the warm-up and at the end of each window."""
    sync = sync or (lambda: None)
    for _ in range(WARMUP_STEPS):
        step()
    sync()
    windows = []
    for _ in range(max(repeats, 1)):
        t = time.perf_counter()
        for _ in range(WINDOW_STEPS):
            step()
        sync()
        windows.append((time.perf_counter() - t) / WINDOW_STEPS)
    return 1e3 * statistics.median(windows)


def _make_step(torch, cfg: Config, teacher, student, tokens, targets, live):
    """One KD training step of `student` against `teacher` on a fixed batch."""
    opt = adamw(torch, student, cfg.optim)
    clip, alpha, temp = cfg.optim.clip_norm, cfg.distill.alpha, cfg.distill.temperature

    def step() -> float:
        with torch.no_grad():
            t_logits = teacher(input_ids=tokens).logits
        s_logits = student(input_ids=tokens).logits
        loss = kd_loss(s_logits, t_logits, targets, alpha, temp, live)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(student.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step
