"""`distill bench --torch`: the same distillation step as a plain PyTorch + transformers loop,
the baseline distill's tokens/s is compared with.

One step: the teacher's forward under `torch.no_grad()`, the student's forward and backward,
loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) dense over the
vocabulary + (1 - alpha) * CE on the next tokens, gradient clipping (`optim.clip_norm`),
then `torch.optim.AdamW` (`optim.lr` held constant, betas, weight decay on matrices only, as
distill's optimizer) and `zero_grad(set_to_none=True)`. Both models are random
`LlamaForCausalLM`s in float32 with SDPA attention, built from the config.json distill
exports (`distill.models.hf_config.to_hf_config`), so their shapes are the teacher's and
the student's.

A batch is `train.batch_size` rows of `train.seq_len` + 1 random token ids (seeded by
`run.seed`) below the tokenizer's vocabulary: the first `seq_len` are the input and the last
`seq_len` the targets, so every position has a target, as on a full packed row of distill's
(one document, every mask 1) and the same tokens per step. Ids past the tokenizer's
vocabulary (a padded model vocabulary) are left out of both softmaxes, as distill masks them.
The divergence is always this dense forward KL, whatever `distill.loss` and `teacher.top_k`
say; distill's pipelined step, which `distill_over_torch` compares it with, follows them.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from distill.config import Config, ModelConfig, OptimConfig
from distill.data.tokenizers import build_tokenizer, vocab_limit
from distill.errors import DistillError
from distill.models import hf_config

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


def hf_llama(transformers, mcfg: ModelConfig, seq_len: int):
    """A random float32 `LlamaForCausalLM` of `mcfg`'s shape, SDPA attention."""
    config = transformers.LlamaConfig.from_dict(
        hf_config.to_hf_config(mcfg, max_position_embeddings=seq_len),
        attn_implementation="sdpa",
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).float()


def _adamw(torch, model, ocfg: OptimConfig):
    """AdamW with weight decay on matrices only (norms exempt), as `student.optim`."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": ocfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=ocfg.lr, betas=(ocfg.b1, ocfg.b2))


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
    """Median step time of the PyTorch KD loop on `cfg`'s shapes: 3 warm-up steps, then
    `repeats` windows of 5 steps, each window's mean step time; the median over windows.

    Runs on the CPU with `torch.set_num_threads(os.cpu_count())` (every core the OS reports;
    the count is returned as `torch_threads`), restored afterwards, their OpenMP wait policy
    passive when torch was first imported by `modules`."""
    torch, transformers = modules()
    bsz, seq = cfg.train.batch_size, cfg.train.seq_len
    live = vocab_limit(build_tokenizer(cfg.data), *cfg.vocab_sizes())
    threads, before = os.cpu_count() or 1, torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(cfg.run.seed)
        teacher = hf_llama(transformers, cfg.teacher.model, seq).eval()
        student = hf_llama(transformers, cfg.student_model(), seq).train()
        gen = torch.Generator().manual_seed(cfg.run.seed)
        ids = torch.randint(0, live or cfg.teacher.model.vocab_size, (bsz, seq + 1), generator=gen)
        step = _make_step(torch, cfg, teacher, student, ids[:, :-1], ids[:, 1:], live)
        for _ in range(WARMUP_STEPS):
            step()
        windows = []
        for _ in range(max(repeats, 1)):
            t = time.perf_counter()
            for _ in range(WINDOW_STEPS):
                step()
            windows.append((time.perf_counter() - t) / WINDOW_STEPS)
    finally:
        torch.set_num_threads(before)
    ms = 1e3 * statistics.median(windows)
    return {
        "torch_step_ms": ms,
        "torch_tokens_per_s": bsz * seq / (ms / 1e3),
        "torch_threads": threads,
        "torch_version": torch.__version__,
    }


def _make_step(torch, cfg: Config, teacher, student, tokens, targets, live):
    """One KD training step of `student` against `teacher` on a fixed batch."""
    opt = _adamw(torch, student, cfg.optim)
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
