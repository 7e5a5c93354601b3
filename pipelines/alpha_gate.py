"""`distill.alpha_gate`: the divergence's weight follows the held-out evaluation.

After each evaluation (`pipelines.hooks.Evaluate`: at the start of a fresh run and every
`train.eval_every` steps), the weight of the next steps is the configured `distill.alpha`
while the teacher predicts the held-out text better than the student (bits per byte), and 0
(cross-entropy alone) once the student has caught up with it (`student.alpha.gated_alpha`).
The executor holds the weight in effect and keeps it in its checkpoints, so a resumed run
trains with the weight the run it resumes was training with. A change is shown to the user
and in the status (`alpha`); every training record carries the step's own `alpha`. While
alpha is 0 the online teacher makes no outputs (the sources' `gate`; the step is the
cross-entropy step, its records' `kd_loss` null), and the on-policy steps
(`distill.on_policy.fraction`) are data steps: the divergence on the student's own samples
would pull it toward a teacher no better than it, and their cross-entropy alone would train
it on its own samples (`pipelines.on_policy.takes_on_policy`). The evaluations still run the
teacher, so an evaluation that finds it better again reopens the gate.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pipelines.hooks import Evaluate, Hook
from student.alpha import compared, gated_alpha

if TYPE_CHECKING:
    from pipelines.loop import Loop

log = logging.getLogger("distill")


class AlphaGate(Hook):
    """Sets the executor's `alpha` from `evaluations.last` (the run's `Evaluate` hook, which
    runs before this one in the list) after each evaluation."""

    def __init__(self, alpha: float, evaluations: Evaluate):
        self.alpha, self.evaluations = alpha, evaluations
        self._seen: int | None = None  # the step of the last evaluation acted on
        self.off_steps = 0  # steps this process trained with alpha 0 (the teacher off)

    def on_start(self, loop: Loop, step: int) -> None:
        self._seen = None
        loop.note(
            f"distill.alpha_gate is on: alpha {self.alpha:g} while the teacher predicts the "
            "held-out text better than the student, 0 (no teacher) once the student has "
            "caught up; distill.alpha_gate: false keeps alpha throughout"
        )
        alpha = loop.executor.alpha
        if loop.store is not None:
            loop.store.update(alpha=alpha)
        _tell_source(loop, alpha)  # a resume's: the checkpoint's
        self._follow(loop)  # a fresh run's evaluation at step 0

    def end_of_step(self, loop: Loop, step: int) -> None:
        if loop.executor.alpha == 0:
            self.off_steps += 1
            if loop.store is not None:
                loop.store.update(teacher_off_steps=self.off_steps)
        self._follow(loop)

    def summary(self) -> dict:
        return {"teacher_off_steps": self.off_steps}

    def _follow(self, loop: Loop) -> None:
        m = self.evaluations.last
        if m is None or m["step"] == self._seen:
            return
        self._seen = m["step"]
        current = loop.executor.alpha
        new = gated_alpha(self.alpha, current, m)
        if new == current:
            return
        loop.executor.set_alpha(new)
        if loop.store is not None:
            loop.store.update(alpha=new)
        gated, on_policy = _tell_source(loop, new)
        s, t = compared(m)
        why = "the teacher is better" if new else "the student has caught up with the teacher"
        steps = "" if new or not gated else "; the steps without the teacher's outputs"
        if on_policy:
            steps += "; on-policy steps as scheduled" if new else "; on-policy steps as data steps"
        reason = f"{why} on the held-out text ({s:.4f} against the teacher's {t:.4f})"
        if loop.store is not None:
            loop.store.alpha_gate(m["step"] + 1, new, reason)
        loop.note(f"alpha {current:g} -> {new:g} from step {m['step'] + 1}: {reason}{steps}")


def _tell_source(loop: Loop, alpha: float) -> tuple[bool, bool]:
    """Open or close the teacher source's gate (`pipelines.sources.OnlineSource.gate`, as
    `OnPolicySource`'s and ray's: with alpha 0 no teacher output, and on-policy steps are
    data steps); (whether the source has a gate: an online teacher, whether the run has
    on-policy steps)."""
    gate = getattr(loop.source, "gate", None)
    return (True, bool(gate(alpha != 0))) if gate is not None else (False, False)
