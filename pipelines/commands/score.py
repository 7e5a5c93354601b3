"""`distill score`: the log-probability a model gives each next token of a text file.

The file is one document, tokenised as the corpus tokenises one (`[BOS] + tokens + [EOS]`,
`distill.data.corpus`), and scored in one row, a chunk of positions at a time: only the
targets' log-probs leave the model, never a long document's [S, V] logits (past 16,744
tokens at 128k ids they would reach 2^31 elements, `distill.limits`). The teacher runs on
its configured inference mesh's `mesh.teacher.tp` (one row: dp 1), the student on one
device from the run's latest checkpoint, or from its initial weights (pretrained, pruned
from the teacher, or random at `run.seed`) when the run has none. Padded vocabulary ids are
masked, as in training, so the numbers compare with transformers' on the tokenizer's ids.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.nn import logsumexp

from distill.collectives import mask_vocab
from distill.config import Config
from distill.data.tokenizers import build_tokenizer, vocab_limit
from distill.errors import DistillError
from distill.types import Batch

PAD_TO = 64  # rows padded to a multiple of this (segment 0, masked): few compiled shapes


def document_ids(cfg: Config, path: str | Path) -> np.ndarray:
    """The ids of the file's text as the corpus packs one document: BOS, tokens, EOS."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DistillError(f"--file {p}: not readable UTF-8 text: {e}") from None
    tok = build_tokenizer(cfg.data)
    ids = np.concatenate([[tok.bos_id], tok.encode(text), [tok.eos_id]]).astype(np.int32)
    if len(ids) < 3:
        raise DistillError(f"--file {p}: empty; nothing to score")
    return ids


def _row(ids: np.ndarray) -> Batch:
    """One row [1, S] padded to a multiple of PAD_TO; targets are the next ids."""
    n = len(ids)
    s = -(-n // PAD_TO) * PAD_TO
    tokens = np.zeros((1, s), np.int32)
    tokens[0, :n] = ids
    seg = np.zeros((1, s), np.int32)
    seg[0, :n] = 1
    pos = np.zeros((1, s), np.int32)
    pos[0, :n] = np.arange(n)
    targets = np.zeros((1, s), np.int32)
    targets[0, : n - 1] = ids[1:]
    mask = np.zeros((1, s), np.float32)
    mask[0, : n - 1] = 1
    return Batch(tokens, targets, seg, pos, mask)


def _teacher_logprobs(cfg: Config, batch: Batch, limit: int | None):
    from distill.mesh import teacher_mesh
    from teacher.forward import forward_for
    from teacher.weights import load_teacher

    tp = cfg.mesh.teacher.tp
    devices = jax.devices()
    if len(devices) < tp:
        raise DistillError(f"mesh.teacher.tp: {tp} devices needed, {len(devices)} here")
    mesh = teacher_mesh(devices[:tp], 1, tp)
    fwd = forward_for(
        cfg.teacher.model, mesh, mode="target_logprobs", dtype=cfg.teacher.dtype,
        vocab_limit=limit,
    )  # fmt: skip
    return fwd(load_teacher(cfg, mesh), batch), "teacher"


def student_program(cfg: Config, limit: int | None):
    """jit((params, batch) -> [B, S] the student's log-probs of the batch's targets), the
    logits formed a chunk of positions at a time (`teacher.forward.by_positions`): a
    document of any length never makes its [S, V] logits whole."""
    from distill.models import model
    from distill.models.vocab_loss import default_chunk
    from teacher.forward import by_positions

    scfg = cfg.student_model()

    def picked(x_c, targets_c, head):
        z = mask_vocab(model.logits(x_c, head, scfg.final_softcap), limit, None)
        return jnp.take_along_axis(z, targets_c[..., None], axis=-1)[..., 0] - logsumexp(z, -1)

    @jax.jit
    def run(params, batch: Batch):
        x, head = model.apply_hidden(
            scfg, params, batch.tokens, batch.segment_ids, batch.positions,
            dtype=cfg.student.dtype,
        )  # fmt: skip
        chunk = default_chunk(head.shape[-1], x.shape[0])
        return by_positions(lambda c: picked(*c, head), (x, batch.targets), chunk)

    return run


def _student_logprobs(cfg: Config, batch: Batch, limit: int | None):
    from jax.sharding import Mesh

    from distill.checkpoint import has_checkpoint
    from distill.mesh import DP, FSDP
    from distill.models import model
    from distill.outputs import checkpoint_dir
    from student.state import latest_params
    from teacher.weights import student_init_params

    scfg = cfg.student_model()
    if has_checkpoint(checkpoint_dir(cfg)):
        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), (DP, FSDP))
        params, step = latest_params(cfg, mesh)
        name = f"student step {step}"
    else:
        params = student_init_params(cfg)
        params = model.init_params(scfg, cfg.run.seed) if params is None else params
        name = "student initial weights"

    return student_program(cfg, limit)(params, batch), name


def score(cfg: Config, path: str | Path, role: str = "teacher") -> dict:
    """{"model", "tokens" (the ids scored), "logprobs" (len(tokens) - 1 floats: each next
    token's), "nll" (their negated mean), "perplexity"} of `role` on the file at `path`."""
    ids = document_ids(cfg, path)
    cfg.resolve_dtypes(jax.devices()[0].platform)
    tok = build_tokenizer(cfg.data)
    limit = vocab_limit(tok, *cfg.vocab_sizes())
    batch = jax.tree.map(jnp.asarray, _row(ids))
    get = _teacher_logprobs if role == "teacher" else _student_logprobs
    picked, name = get(cfg, batch, limit)  # [1, S]
    logprobs = np.asarray(jax.device_get(picked))[0, : len(ids) - 1].astype(np.float64)
    nll = float(-logprobs.mean())
    return {
        "model": name,
        "tokens": [int(i) for i in ids],
        "logprobs": [float(x) for x in logprobs],
        "nll": nll,
        "perplexity": math.exp(nll),
    }
