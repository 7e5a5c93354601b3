"""AdamW with linear warmup and cosine decay, global-norm clipping, no decay on norms."""

from __future__ import annotations

import jax
import optax

from distill.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


# Never decayed: DeepSeek's selection-only router bias and Gemma 4's layer scalars, which no
# gradient trains (transformers' buffers), and Gemma 4's router scales, vectors as norms are.
NO_DECAY = ("router_correction", "layer_scalar", "router_scale", "router_expert_scale")


def decay_mask(params):
    """Weight decay on matrices only: norms (vectors, or [L, D] stacked) are exempt, and
    `NO_DECAY`."""

    def is_matrix(path, x):
        name = str(path[-1].key) if hasattr(path[-1], "key") else str(path[-1])
        return not name.endswith("norm") and name not in NO_DECAY and x.ndim >= 2

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.clip_norm:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(
        optax.adamw(
            schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    )
    return optax.chain(*parts)
