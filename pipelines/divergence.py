"""Stop a run whose training diverged: `train.max_nonfinite_steps` skipped steps in a row.

The student step skips a step whose loss or gradient norm is not finite and counts the
skips on device (`student.train.Skips`); the loop hands the guard the metrics it reads
anyway (lagged, only the recorded steps), so watching costs no extra wait on the device.
The counters carry the longest run of skips, so a run that began and ended between two
reads is still seen at the next one; since a skipped step leaves the weights as they were,
seeing it a few steps late loses nothing.
"""

from __future__ import annotations

from pipelines.hooks import Hook
from pipelines.loop import Loop
from student.train import GRAD_NORM, LOSS


class Divergence(Hook):
    """At each logged step, `check(step, metrics)`; a reason fails the run (`Loop.fail`: no
    evaluation or checkpoint of this state, the checkpoints being written completed).

    `check(step, metrics)` gives the one-line reason the run must stop, or None.

    `metrics`: one read step's metrics as host floats, with the step's `nonfinite_run`,
    `nonfinite_longest` and `nonfinite_kinds` (`student.train.skip_metrics`)."""

    def __init__(self, max_nonfinite_steps: int):
        self.limit = max_nonfinite_steps

    def check(self, step: int, metrics: dict) -> str | None:
        longest = int(metrics.get("nonfinite_longest", 0))
        if longest < self.limit:
            return None
        run, kinds = int(metrics["nonfinite_run"]), int(metrics["nonfinite_kinds"])
        what = " and ".join(
            n for bit, n in ((LOSS, "loss"), (GRAD_NORM, "grad_norm")) if kinds & bit
        )
        limit = f"train.max_nonfinite_steps={self.limit}"
        if run >= self.limit:
            return (
                f"training diverged: non-finite {what} at steps {step - run + 1}..{step} "
                f"({run} in a row, {limit}); the weights are those after step {step - run}"
            )
        return (
            f"training diverged: non-finite {what} for {longest} steps in a row before "
            f"step {step} ({limit})"
        )

    def on_metrics(self, loop: Loop, step: int, metrics: dict, record: dict) -> None:
        if (reason := self.check(step, metrics)) is not None:
            loop.fail(reason)
