"""What the user sees: a progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import shutil
import sys
import time

from tqdm import tqdm

from student import routing

log = logging.getLogger("distill")


def distill_record(step: int, metrics: dict, figures: dict, teachers: tuple[str, ...] = ()) -> dict:
    """One metrics.jsonl training record: the step's losses and lr (host floats) plus the
    loop's own figures (tokens_per_s, teacher_ms, student_ms, busy fractions, ...); an MoE
    student's `moe_aux_loss` and expert load (`student.routing.load_record`); with several
    `teachers` (their names), `kd_loss_by_teacher`: each one's divergence."""
    keys = ("loss", "ce_loss", "lr", "grad_norm")
    by_teacher = metrics.get("kd_loss_teachers")
    if teachers and by_teacher is not None:
        each = {n: None if v != v else v for n, v in zip(teachers, by_teacher, strict=True)}
        figures = {"kd_loss_by_teacher": each, **figures}  # None: no rows of that teacher
    return {
        "step": step,
        "phase": "distill",
        **{k: metrics[k] for k in keys},
        "kd_loss": metrics.get("kd_loss"),  # None: a step without the teacher (alpha 0)
        **{k: metrics[k] for k in ("aligned_fraction",) if k in metrics},  # cross-tokenizer
        **{k: metrics[k] for k in ("alpha",) if k in metrics},  # the step's `distill.alpha`
        **routing.load_record(metrics),  # a mixture-of-experts student
        **figures,
        "time": time.time(),
    }


class Progress:
    def __init__(self, total: int, start: int, name: str):
        self._bar = None
        if sys.stderr.isatty():
            size = shutil.get_terminal_size((100, 24))  # a pty reporting 0x0 gets 100x24
            self._bar = tqdm(
                total=total,
                initial=start,
                desc=name,
                unit="step",
                ncols=size.columns,
                nrows=size.lines,
            )
        self._last = start

    def update(self, step: int, record: dict) -> None:
        if self._bar is not None:
            self._bar.update(step - self._last)
            self._bar.set_postfix(
                loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False
            )
        else:
            kd = record["kd_loss"]
            log.info(
                "step %d loss %.4f kd %s ce %.4f lr %.2e %.0f tok/s teacher %.0fms student %.0fms",
                step,
                record["loss"],
                "-" if kd is None else f"{kd:.4f}",
                record["ce_loss"],
                record["lr"],
                record["tokens_per_s"],
                record["teacher_ms"],
                record["student_ms"],
            )
        self._last = step

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            log.info("%s", text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
