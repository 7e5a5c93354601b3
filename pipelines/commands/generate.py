"""`distill generate`: continue prompts with a run's latest student checkpoint (or its
teacher), through the run's tokenizer.

Each prompt is one document's start, `[BOS] + tokens`, as the corpus packs documents; with
`--chat` it is instead a user message (after `--system`, when given) rendered through the
run's chat template with its generation prompt (`distill.data.chat`), and the completion
printed is the assistant's answer alone. The prompts are left-padded to one length and
continued by `distill.models.decode.generate` (a KV cache) until a stop id (EOS or BOS) or
`max_new_tokens`. The student is restored onto one device; the teacher onto the first
`mesh.teacher.tp` devices (one when fewer are here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from distill.config import Config
from distill.data.tokenizers import build_tokenizer, vocab_limit
from distill.mesh import teacher_mesh
from distill.models import decode
from distill.types import Prompts
from student.generate import stop_ids
from student.state import latest_params
from teacher.weights import load_teacher


def _docs(cfg: Config, tokenizer, texts: list[str], chat: bool, system: str | None) -> list:
    """The prompt ids of ``texts``: documents' starts, or user turns through the template."""
    if not chat:
        return [np.concatenate([[tokenizer.bos_id], tokenizer.encode(t)]) for t in texts]
    from distill.data.chat import load_template

    template = load_template(cfg.data, tokenizer)
    head = [{"role": "system", "content": system}] if system is not None else []
    rendered = [
        template.render([*head, {"role": "user", "content": t}], add_generation_prompt=True)
        for t in texts
    ]
    return [ids for ids, _ in tokenizer.encode_offsets(rendered)]


def _prompts(docs: list) -> Prompts:
    p = max(len(d) for d in docs)
    tokens = np.zeros((len(docs), p), np.int32)
    seg = np.zeros((len(docs), p), np.int32)
    pos = np.zeros((len(docs), p), np.int32)
    for i, d in enumerate(docs):
        tokens[i, p - len(d) :], seg[i, p - len(d) :] = d, 1
        pos[i, p - len(d) :] = np.arange(len(d))
    return Prompts(tokens, seg, pos)


def _model(cfg: Config, teacher: bool):
    """(model config, parameters, compute dtype, checkpoint step or None) to sample from."""
    devices = jax.devices()
    if teacher:
        tp = cfg.mesh.teacher.tp if len(devices) >= cfg.mesh.teacher.tp else 1
        params = load_teacher(cfg, teacher_mesh(devices[:tp], 1, tp))
        return cfg.teacher.model, params, cfg.teacher.dtype, None
    from jax.sharding import Mesh

    from distill.mesh import DP, FSDP

    mesh = Mesh(np.array(devices[:1]).reshape(1, 1), (DP, FSDP))
    params, step = latest_params(cfg, mesh)
    return cfg.student_model(), params, cfg.student.dtype, step


def generate_text(
    cfg: Config,
    texts: list[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    teacher: bool = False,
    seed: int = 0,
    chat: bool = False,
    system: str | None = None,
) -> list[dict]:
    """One {"prompt", "completion", "tokens", "stopped"} per prompt; with ``chat`` each
    prompt is a user message through the chat template (after ``system``)."""
    cfg.resolve_dtypes(jax.devices()[0].platform)
    tokenizer = build_tokenizer(cfg.data)
    mcfg, params, dtype, step = _model(cfg, teacher)
    stops = stop_ids(tokenizer)
    run = jax.jit(
        lambda params, prompts, key: decode.generate(
            mcfg, params, prompts, key,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            stop_ids=stops, vocab_limit=vocab_limit(tokenizer, mcfg.vocab_size), dtype=dtype,
        )
    )  # fmt: skip
    prompts = jax.tree.map(jnp.asarray, _prompts(_docs(cfg, tokenizer, texts, chat, system)))
    tokens, valid, _ = jax.device_get(run(params, prompts, jax.random.key(seed)))
    out = []
    for text, ids, ok in zip(texts, tokens, valid, strict=True):
        ids = [int(i) for i in ids[ok]]
        stopped = bool(ids) and ids[-1] in stops
        body = ids[:-1] if stopped else ids
        out.append(
            {
                "prompt": text,
                "completion": tokenizer.decode(np.array(body, np.int32)),
                "tokens": len(ids),
                "stopped": stopped,
                "model": "teacher" if teacher else f"student step {step}",
            }
        )
    return out
