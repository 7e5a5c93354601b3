"""The student's sampler on the training mesh, and the recent parameters it samples with.

`Sampler` is `distill.models.decode.generate` compiled for the training mesh: prompts split over
its devices like a batch (`dp` x `fsdp`), the parameters in their training layout (XLA
gathers each fully sharded weight where it is used), the continuations turned into
training rows (`distill.models.decode.continuation_batch`) on the same devices, so an on-policy
batch never leaves the mesh before the teacher scores it.

Decoding (and a short prompt's prefill) moves activations rather than weights where that
is cheaper: a few tokens per row are far smaller than a layer's weights, so XLA keeps a
weight split, computes its output features split, then lays the result out by rows again.
Where the model has fewer KV heads than `fsdp` (tiny test models; Qwen2.5-1.5B's 2 at
fsdp=4), queries split over heads span two dimensions of their [B, 1, KV, H/KV, hd] form and
XLA moves them by gathering them whole, printing "Involuntary full rematerialization" while
compiling: one token's queries per layer (a short prefill's keys and scores), the size of
the hidden states the program gathers anyway. Constraining them to rows silences it, but
XLA then gathers wq and wo whole per layer and token instead (MBs each), so it stays.

`ParamHistory` keeps the student's parameters after each of the last few steps: on-policy
training generates step n's continuations with the parameters after step n-1-staleness,
while the train state itself is donated step after step. The parameters it holds are saved
with each checkpoint, so that a resume generates exactly what the uninterrupted run did.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill import programs
from distill.checkpoint import Checkpointer
from distill.config import Config, ModelConfig
from distill.models import decode
from distill.types import Batch, Prompts
from student import sharding


def stop_ids(tokenizer) -> tuple[int, ...]:
    """Ids that end a continuation: EOS, and BOS (another document's start)."""
    return tuple(sorted({tokenizer.eos_id, tokenizer.bos_id}))


class Sampler:
    """sample(params, prompts, key) -> (rows [B, seq_len] of prompts and continuations,
    {"tokens": generated token count, "logp": the summed log-probabilities of the generated
    tokens under the sampling distribution}, on device): dispatched, not waited for."""

    def __init__(
        self,
        cfg: ModelConfig,
        mesh,
        *,
        seq_len: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop: tuple[int, ...],
        vocab_limit: int | None,
        dtype: str,
    ):
        split = NamedSharding(mesh, sharding.whole_rows_spec(mesh))  # whole rows: decoding

        def run(params, prompts: Prompts, key) -> tuple[Batch, dict]:
            tokens, valid, logp = decode.generate(
                cfg, params, prompts, key,
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                stop_ids=stop, vocab_limit=vocab_limit, dtype=dtype, rows=split,
            )  # fmt: skip
            batch = decode.continuation_batch(prompts, tokens, valid, seq_len)
            return batch, {"tokens": jnp.sum(valid.astype(jnp.int32)), "logp": jnp.sum(logp)}

        self.put = split
        self._run = jax.jit(
            run,
            in_shardings=(None, split, None),
            out_shardings=(split, NamedSharding(mesh, P())),
        )

    def __call__(self, params, prompts: Prompts, key):
        return self._run(params, jax.device_put(prompts, self.put), key)

    def compiled(self, params, prompts: Prompts, key):
        """The program compiled for abstract arguments (`distill plan`'s memory figures)."""
        return self._run.lower(params, prompts, key).compile()


def sampler_for(cfg: Config, mesh, tokenizer, vocab_limit: int | None, *, temperature=None):
    """The run's sampler: `distill.on_policy` lengths, temperature (or `temperature`) and
    top-p, the student's compute dtype."""
    op = cfg.distill.on_policy
    _, n = op.lengths(cfg.train.seq_len)
    return programs.cached(
        Sampler,
        cfg.student_model(),
        mesh,
        seq_len=cfg.train.seq_len,
        max_new_tokens=n,
        temperature=op.temperature if temperature is None else temperature,
        top_p=op.top_p if temperature is None else 1.0,
        stop=stop_ids(tokenizer),
        vocab_limit=vocab_limit,
        dtype=cfg.student.dtype,
    )


_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


class ParamHistory:
    """The parameters after each of the last `staleness` + 1 steps, by step.

    `after(j)` is the parameters after step j. With staleness 0 nothing is copied: the
    current parameters are read by a generation dispatched before the next step. Otherwise
    each step's new parameters are copied (one parameter set per kept step, laid out as
    the state's), and a checkpoint at step c saves those of steps c-staleness .. c-1."""

    def __init__(self, staleness: int, abstract_params):
        self.staleness = staleness
        self._abstract = abstract_params  # with the state's shardings (`restore`)
        self._kept: dict[int, dict] = {}
        self._current: tuple[int, dict] | None = None

    def _needed(self, step: int) -> list[int]:
        return sorted({max(j, 0) for j in range(step - self.staleness, step)} - {step})

    def start(self, step: int, params, ckpt: Checkpointer | None) -> None:
        self._kept.clear()
        if step and self.staleness and ckpt is not None:
            need = self._needed(step)
            target = {str(j): self._abstract for j in need}
            restored = ckpt.restore_extra(step, {"recent_params": target})["recent_params"]
            self._kept = {int(j): p for j, p in restored.items()}
        self.record(step, params)

    def record(self, step: int, params) -> None:
        """After dispatching step `step` (its new parameters `params`)."""
        self._current = (step, params)
        if self.staleness:
            self._kept[step] = _copy(params)
            for j in [j for j in self._kept if j < step - self.staleness]:
                del self._kept[j]

    @property
    def latest(self) -> int:
        """The last step recorded (the start step before any)."""
        return self._current[0]

    def after(self, step: int):
        if self._current is not None and self._current[0] == step and not self.staleness:
            return self._current[1]
        return self._kept[step]

    def extra(self, step: int) -> dict | None:
        """What a checkpoint at `step` saves beside the state (None: nothing)."""
        need = self._needed(step) if self.staleness else []
        return {"recent_params": {str(j): self._kept[j] for j in need}} if need else None
