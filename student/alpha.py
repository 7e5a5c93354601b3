"""The divergence's weight in effect (`distill.alpha`), and the rule that lowers it.

A teacher that predicts the held-out text worse than the student can no longer teach it
on this data: measured on the quick start's corpus, a BPE student distilled from a byte-
level teacher worse than it ended up to 20% worse (bits per byte) than the student trained
on its own tokens alone, the more so the larger `alpha`
(docs/benchmarks/2026-11-27-cross-tokenizer-alpha.md). With `distill.alpha_gate` on, each
evaluation compares the two models on the held-out text (bits per byte, so that different
tokenizers compare): while the teacher is better the loss is the configured one; once the
student has caught up, `alpha` is 0 (cross-entropy alone) until an evaluation finds the
teacher better again.

`alpha` is a constant of the compiled step (the configured value gives the same program,
to the bit, as a run without the gate): `AlphaSteps` holds one compiled step per value
used, two at most. While alpha is 0 the teacher sources make no output (their `gate`), and
a step given none is the cross-entropy step, which takes none: the teacher's forward is
skipped, not computed for a loss that does not use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from distill.config import Config
from student import train


def compared(evaluation: dict) -> tuple[float, float] | None:
    """(student, teacher) on the held-out text as the rule compares them: bits per byte (one
    vocabulary without them: the losses, in the same tokens); None when the evaluation does
    not say (no such figures, or one not finite)."""
    if "student_bpb" in evaluation and "teacher_bpb" in evaluation:
        s, t = evaluation["student_bpb"], evaluation["teacher_bpb"]
    elif "kl" in evaluation:  # one vocabulary: the losses are in the same tokens
        s, t = evaluation.get("student_loss"), evaluation.get("teacher_loss")
    else:
        return None
    if s is None or t is None or not (math.isfinite(s) and math.isfinite(t)):
        return None
    return s, t


def gated_alpha(alpha: float, current: float, evaluation: dict) -> float:
    """The weight for the steps after `evaluation`: the configured `alpha` while the teacher
    is better, 0 once it is not; `current` when the evaluation does not say."""
    pair = compared(evaluation)
    if pair is None:
        return current
    student, teacher = pair
    return alpha if teacher < student else 0.0


class AlphaSteps:
    """step(state, batch, teacher_out) with the `alpha` in effect: `build(alpha)` gives the
    compiled step of that weight (built once per value, kept); a step given no teacher
    output (None: made while alpha is 0) is `build_ce()`'s cross-entropy step(state, batch),
    built when first needed."""

    def __init__(
        self, build: Callable[[float], Callable], alpha: float, build_ce: Callable[[], Callable]
    ):
        self._build, self._build_ce, self._steps = build, build_ce, {}
        self._ce: Callable | None = None
        self.configured = float(alpha)
        self.alpha = self.configured
        self.set(self.configured)

    def set(self, alpha: float) -> None:
        """Train the next steps with `alpha`."""
        self.alpha = float(alpha)
        if self.alpha not in self._steps:
            self._steps[self.alpha] = self._build(self.alpha)

    def __call__(self, state, batch, teacher_out):
        if teacher_out is not None:
            return self._steps[self.alpha](state, batch, teacher_out)
        if self.alpha != 0:
            raise ValueError(f"a step without a teacher output at alpha {self.alpha:g}")
        if self._ce is None:
            self._ce = self._build_ce()
        return self._ce(state, batch)

    def note(self) -> dict:
        """What a checkpoint keeps of it, so that a resumed run trains as the run it resumes."""
        return {"alpha": self.alpha}

    def restore(self, note: dict | None) -> None:
        """Take up a checkpoint's `note()`; a checkpoint without one keeps the configured
        weight (written before the gate, or with it off)."""
        if note and "alpha" in note:
            self.set(note["alpha"])


def alpha_steps_for(cfg: Config, mesh, vocab_limit: int | None = None, *, cross=None):
    """(tx, `student.alpha.AlphaSteps`): the run's distillation step for the `distill.alpha`
    in effect, the configured one first (`distill_step_for`'s step, the same program), and
    its cross-entropy step for the steps without a teacher output."""

    def build(alpha: float, with_teacher: bool = True) -> Callable:
        here = cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"alpha": alpha})})
        return train.distill_step_for(
            here, mesh, vocab_limit, with_teacher=with_teacher, cross=cross
        )[1]

    tx, _ = train.distill_step_for(cfg, mesh, vocab_limit, cross=cross)
    return tx, AlphaSteps(build, cfg.distill.alpha, lambda: build(0.0, with_teacher=False))
