"""On-policy distillation: the student's own continuations, scored by the teacher.

`OnPolicySource` is a teacher source of the one loop (`pipelines.loop`). For a share
`distill.on_policy.fraction` of the steps (GKD's lambda; which steps is a function of the
run seed and the step, so a resume picks the same ones) it takes the first
`distill.on_policy.prompt_len` tokens of the step's packed rows as prompts, samples
`max_new_tokens` tokens from the student on the training mesh (`student.generate`) with
the parameters after step n-1-`pipeline.max_staleness`, and has the teacher score the rows
so made on the inference mesh (its usual dense or top-k output). The student's loss is
then masked to the generated tokens (`distill.models.decode.continuation_batch`). The other steps
are the data's rows, as off-policy distillation. Everything is dispatched, never waited
for: generation for a later step runs while the student trains on an earlier one, and the
teacher scores while the student generates or trains. Step n's sampling key is
fold_in(key(run.seed), n): nothing to store, and a resume draws what the uninterrupted run
drew (the parameters it draws with are in the checkpoint: `student.generate.ParamHistory`).
While the `distill.alpha_gate` holds alpha at 0 (the teacher no better than the student on
the held-out text) the on-policy steps are data steps, cross-entropy alone on the data's
rows (`takes_on_policy`), and the teacher makes no output for them; an item made before
the gate changed is remade when popped.

`SampleScore` is the metric every evaluation reports: the student continues the held-out
prompts (the first tokens of every evaluation row; temperature 1, fixed keys) and the
teacher scores the continuations: `sample_teacher_nll` (the teacher's mean NLL per
generated token) and `sample_len`.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from distill.config import Config
from distill.data.corpus import Corpus
from distill.data.cross.samples import SampleRows
from distill.data.prompts import PromptSet, answer_prompts, prompt_set
from distill.data.tokenizers import vocab_limit
from distill.errors import DistillError
from distill.models import decode
from distill.observability.timing import ReadyWatcher
from distill.types import Batch, Prompts
from pipelines.evaluation import eval_batches
from pipelines.sources import QueueSource
from student.generate import ParamHistory, Sampler, sampler_for
from teacher.online import OnlineTeacher

SAMPLE_KEY = 0x5A3E  # folded into the run seed's key for the evaluation samples
SAMPLE_KEYS = ("sample_teacher_nll", "sample_student_nll", "sample_kl", "sample_len")


def check_on_policy(cfg: Config) -> None:
    """The on-policy keys against the rows and the pipeline (before any device work)."""
    op, seq_len = cfg.distill.on_policy, cfg.train.seq_len
    p, n = op.lengths(seq_len)
    if p + n > seq_len + 1:
        key = "max_new_tokens" if op.max_new_tokens else "prompt_len"
        raise DistillError(
            f"distill.on_policy.{key}: prompt_len {p} + max_new_tokens {n} exceed "
            f"train.seq_len + 1 = {seq_len + 1} (a prompt and its continuation fill one row)"
        )
    if op.fraction == 0:
        return
    if cfg.teacher.source == "cache":
        raise DistillError(
            "distill.on_policy.fraction: on-policy distillation needs the teacher online to "
            "score the student's continuations; teacher.source cache holds only the data's"
        )
    if cfg.pipeline.prefetch > cfg.pipeline.max_staleness + 1:
        raise DistillError(
            f"pipeline.prefetch: {cfg.pipeline.prefetch} batches in flight need parameters "
            f"older than pipeline.max_staleness={cfg.pipeline.max_staleness} allows; set "
            f"prefetch <= {cfg.pipeline.max_staleness + 1} or raise max_staleness"
        )


def step_prompts(prompts: PromptSet | None, batch: Batch, step: int, prompt_len: int) -> Prompts:
    """Step `step`'s prompts: from `data.prompt_field` when set, else the first
    `prompt_len` tokens of the step's rows."""
    if prompts is not None:
        return prompts.batch(step, batch.tokens.shape[0])
    return decode.prompts_of(batch, prompt_len)


def is_on_policy(seed: int, step: int, fraction: float, start_step: int = 0) -> bool:
    """Whether `step` trains on the student's continuations: never up to `start_step`, then
    with probability `fraction` (a pure function of the arguments)."""
    if step <= start_step or fraction <= 0 or fraction >= 1:
        return step > start_step and fraction >= 1
    return bool(np.random.default_rng([seed % 2**32, step]).random() < fraction)


def takes_on_policy(cfg: Config, step: int, gate_open: bool) -> bool:
    """Whether step `step` trains on the student's continuations: an on-policy step of the
    schedule (`is_on_policy`) while the `distill.alpha_gate` is open. While the gate holds
    alpha at 0 the teacher cannot teach, and the step is a data step (cross-entropy alone)
    on the data's rows it would have taken its prompts from: which step is which is then a
    function of the seed, the step and the alpha the step trains with, so a resume (whose
    checkpoint keeps that alpha) takes the same ones."""
    op = cfg.distill.on_policy
    return gate_open and is_on_policy(cfg.run.seed, step, op.fraction, op.start_step)


def schedule_figures(cfg: Config, steps: range, taken: dict[int, bool] | None = None) -> dict:
    """The on-policy share of `steps` and their mean staleness (the parameters a step
    samples with are min(max_staleness, step - 1) steps old): from `taken` (step -> whether
    it trained on-policy) where it has the step, else from the schedule: exactly the
    logged steps', whichever batches are in flight ahead of them."""
    op, staleness, taken = cfg.distill.on_policy, cfg.pipeline.max_staleness, taken or {}
    on = [
        s for s in steps if taken.get(s, is_on_policy(cfg.run.seed, s, op.fraction, op.start_step))
    ]
    return {
        "on_policy": len(on) / max(len(steps), 1),
        "staleness": sum(min(staleness, s - 1) for s in on) / len(on) if on else 0.0,
    }


class Made(NamedTuple):
    """What an in-flight item of `OnPolicySource` was made as."""

    step: int
    data: Batch  # the data's rows of the step (its prompts; the rows of a data step)
    tokens: jax.Array | None  # the generated-token count on device; None: a data step
    taught: bool  # made with the teacher's output (not: a data step while the gate is closed)


class OnPolicySource(QueueSource):
    """Batches of the corpus in data order; on the on-policy steps replaced by prompts and
    the student's continuations, scored by the online teacher (module docstring)."""

    def __init__(
        self,
        cfg: Config,
        corpus: Corpus,
        teacher: OnlineTeacher,
        sampler: Sampler,
        history: ParamHistory,
    ):
        bsz, seed = cfg.train.batch_size, cfg.run.seed
        super().__init__(
            lambda: corpus.train_iterator(bsz, seed),
            self._work,
            ReadyWatcher("teacher", devices=teacher.mesh.devices.flat),
            dropping=cfg.teacher.moe_capacity_factor is not None,
        )
        self.teacher, self._sampler, self._history = teacher, sampler, history
        self._cfg, op = cfg, cfg.distill.on_policy
        self._fraction = op.fraction
        self._prompt_len, _ = op.lengths(cfg.train.seq_len)
        self._prompts = prompt_set(cfg, corpus.tokenizer)  # None: the rows' first tokens
        self._staleness = cfg.pipeline.max_staleness
        self._key = jax.random.key(seed)
        self._gen_watch = ReadyWatcher("generate")
        self._next_step = 1
        self._open = True  # the `distill.alpha_gate` (`gate`)
        # what the batches in flight were made as, in order; the generated-token counts of
        # the recent on-policy ones handed to the student; whether recent steps were
        self._in_flight: deque[Made] = deque()
        self._generated: deque[jax.Array] = deque(maxlen=256)
        self._taken: dict[int, bool] = {}
        # across tokenizers: the teacher's rows of the samples, made on a host thread
        self._cross = None
        if corpus.teacher is not None:
            self._cross = SampleRows(corpus.tokenizer, corpus.teacher, corpus.train.teacher_len)
            self._host = ThreadPoolExecutor(1, thread_name_prefix="cross-samples")

    def start(self, data_state: dict | None) -> None:
        super().start(data_state)
        self._in_flight.clear()
        self._next_step = self._history.latest + 1  # the executor has started: its step

    def gate(self, open_: bool) -> bool:
        """The `distill.alpha_gate` for the steps not yet popped: open (the configured alpha)
        or closed (alpha 0: their on-policy steps are data steps, `takes_on_policy`, and no
        step has a teacher output). Items in flight are remade when popped, if made
        otherwise. True: the run has on-policy steps."""
        self._open = bool(open_)
        return self._fraction > 0

    def pop(self):
        self._settle()
        made = self._in_flight.popleft()
        if made.tokens is not None:
            self._generated.append(made.tokens)
        self._taken[made.step] = made.tokens is not None
        self._taken.pop(made.step - 4096, None)  # steps are popped one by one, in order
        return super().pop()

    def peek(self):
        self._settle()
        return super().peek()

    def _settle(self) -> None:
        """The oldest item as the gate now wants it (remade when it was made for the gate
        as it stood when it was submitted), its teacher work waited for when it is still
        being made on the host thread."""
        made = self._in_flight[0]
        on_policy = takes_on_policy(self._cfg, made.step, self._open)
        if on_policy != (made.tokens is not None) or made.taught != self._open:
            head = self._queue[0]
            (batch, out, load), tokens = self._make(made.step, made.data)
            self._in_flight[0] = made._replace(tokens=tokens, taught=self._open)
            if not isinstance(batch, Future) and out is not None:
                self._watch.watch(out)
            self._queue[0] = head._replace(batch=batch, teacher_out=out, tag=load)
        self._resolve()

    def _resolve(self) -> None:
        """The oldest item's teacher work, when it is still being made on the host thread
        (on-policy across tokenizers): waited for now that the loop needs it."""
        head = self._queue[0]
        if isinstance(head.batch, Future):
            batch, out, load = head.batch.result()
            self._watch.watch(out)
            self._queue[0] = head._replace(batch=batch, teacher_out=out, tag=load)

    def _score_samples(self, rows):
        """(the host rows with the teacher's rows of their text, the teacher's output and
        load, dispatched): on the host thread, which waits for the generation."""
        host = jax.device_get(rows)
        batch = host._replace(teacher=self._cross.view(host))
        return batch, *self.teacher.output(batch)

    def _work(self, batch: Batch):
        step, self._next_step = self._next_step, self._next_step + 1
        work, tokens = self._make(step, batch)
        self._in_flight.append(Made(step, batch, tokens, self._open))
        return work

    def _make(self, step: int, batch: Batch) -> tuple[tuple, jax.Array | None]:
        """((batch, teacher output, load), the generated-token count or None) of step
        `step` from its data rows `batch`, as the gate now wants it."""
        if not self._open:  # alpha 0: cross-entropy alone, on the data's rows
            return (batch, None, None), None
        if not takes_on_policy(self._cfg, step, self._open):
            return (batch, *self.teacher.output(batch)), None
        source_step = max(step - 1 - self._staleness, 0)
        params = self._history.after(source_step)
        prompts = step_prompts(self._prompts, batch, step, self._prompt_len)
        rows, stats = self._sampler(params, prompts, jax.random.fold_in(self._key, step))
        self._gen_watch.watch(stats["tokens"])
        if self._cross is not None:  # re-tokenised for the teacher off the loop's thread
            return (self._host.submit(self._score_samples, rows), None, None), stats["tokens"]
        return (rows, *self.teacher.output(rows)), stats["tokens"]

    def figures(self, steps: int, since: float, step: int) -> dict:
        """The teacher's figures; the on-policy share and staleness of the logged steps
        (step - steps, step] (`schedule_figures`); and, when some of them were on-policy,
        the mean generation ms and generated tokens/s of as many recent generations."""
        window = schedule_figures(self._cfg, range(step - steps + 1, step + 1), self._taken)
        n = round(window["on_policy"] * steps)
        recent = list(self._generated)[-n:] if n else []
        ready = [int(c) for c in recent if c.is_ready()]
        gen_ms = self._gen_watch.recent_ms(len(recent)) if recent else 0.0
        return {
            **super().figures(steps, since),
            **window,
            "generate_ms": gen_ms,
            "gen_tokens_per_s": (
                sum(ready) / len(ready) / (gen_ms / 1e3) if ready and gen_ms > 0 else 0.0
            ),
            "generate_busy": self._gen_watch.busy_fraction(since),
        }

    def eval_logits(self, batches: list):
        return self.teacher.eval_logits(batches)

    def close(self) -> None:
        super().close()
        self._gen_watch.close()
        if self._cross is not None:
            self._host.shutdown(cancel_futures=True)


def sample_score(cfg: Config, corpus: Corpus, teacher: OnlineTeacher, mesh: Mesh) -> SampleScore:
    """The run's sample metrics: the evaluation rows' prompts, continued on the training
    mesh `mesh` at temperature 1."""
    limit = vocab_limit(corpus.tokenizer, *cfg.vocab_sizes())
    sampler = sampler_for(cfg, mesh, corpus.tokenizer, limit, temperature=1.0)
    return SampleScore(cfg, eval_batches(cfg, corpus), sampler, teacher)


def eval_prompts(cfg: Config, batches: list[Batch]) -> list[Prompts]:
    """The evaluation's prompts, a chunk per evaluation chunk (`eval_batches`): the first
    `distill.on_policy.prompt_len` tokens of every held-out row (of chat data and pairs,
    its first conversation up to the answer, `answer_prompts`). All of them, not one
    chunk's: a mean over 16 prompts' samples has a standard error of about 0.1 nats."""
    p, _ = cfg.distill.on_policy.lengths(cfg.train.seq_len)
    if cfg.data.is_examples:  # conversations and pairs: up to the first answer
        return [answer_prompts(b, p) for b in batches]
    return [decode.prompts_of(b, p) for b in batches]


def eval_sample_key(run_key, chunk: int):
    """The key chunk `chunk` of the evaluation's prompts is sampled with, from the run's
    key(run.seed): the same at every evaluation and in every mode."""
    return jax.random.fold_in(jax.random.fold_in(run_key, SAMPLE_KEY), chunk)


class SampleScore:
    """score(params) -> `sample_metrics`: the student continues the held-out prompts at
    temperature 1 with fixed keys, the teacher scores the continuations."""

    def __init__(self, cfg: Config, batches: list[Batch], sampler: Sampler, teacher: OnlineTeacher):
        self._prompts = eval_prompts(cfg, batches)
        self._sampler, self._teacher = sampler, teacher
        self._key = jax.random.key(cfg.run.seed)

    def __call__(self, params) -> dict:
        sums = []
        for i, prompts in enumerate(self._prompts):  # every chunk dispatched, then read
            rows, stats = self._sampler(params, prompts, eval_sample_key(self._key, i))
            sums.append((self._teacher.nll(rows)[0], stats))
        return sample_metrics(
            sum(float(nll) for nll, _ in sums),
            -sum(float(stats["logp"]) for _, stats in sums),
            sum(int(stats["tokens"]) for _, stats in sums),
            sum(p.tokens.shape[0] for p in self._prompts),
        )


def sample_metrics(teacher_nll: float, student_nll: float, tokens: int, prompts: int) -> dict:
    """The evaluation's sample metrics from sums over the generated tokens: the teacher's
    and the student's mean NLL per token, their difference (a Monte Carlo estimate of
    KL(student || teacher) per token along the student's own samples: 0 for samples exactly
    as the teacher would draw them) and the mean continuation length."""
    t, s = teacher_nll / max(tokens, 1), student_nll / max(tokens, 1)
    return {
        "sample_teacher_nll": t,
        "sample_student_nll": s,
        "sample_kl": t - s,
        "sample_len": tokens / prompts,
    }
