"""Which features compose: every pair of them runs, or `distill validate` refuses it in one
line naming why, before any device work.

This module is the one place that says so. `docs/reference/composition.md` is generated
from it (`python -m pipelines.composition`), and `tests/test_composition.py` runs every
pair the table says runs (a few steps at the tiny size of the tests) and checks every
refusal's line. A feature is the settings that turn it on, as `--set` takes them, over a
split layout of a teacher (tp) and a student (dp); `<name>` placeholders are the files a
feature needs (a trained MoE teacher, a BPE tokenizer, a pretrained student), which the
test makes.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "reference" / "composition.md"


@dataclass(frozen=True)
class Feature:
    name: str
    title: str  # what a user calls it
    settings: tuple[str, ...]  # `--set` overrides that turn it on


FEATURES = (
    Feature("colocated", "colocated placement", ("mesh.placement=colocated",)),
    Feature("auto", "placement auto", ("mesh.placement=auto",)),
    Feature("cp", "context parallelism", ("mesh.student.cp=2",)),
    Feature("pp", "teacher pipeline stages", ("mesh.teacher.pp=2",)),
    Feature(
        "ep",
        "MoE teacher over ep",
        (
            "teacher.checkpoint=<moe_teacher>",
            "teacher.model.n_experts=4",
            "teacher.model.experts_per_token=2",
            "teacher.model.d_ff_expert=32",
            "mesh.teacher.tp=1",
            "mesh.teacher.ep=2",
        ),
    ),  # fmt: skip
    Feature(
        "on_policy",
        "on-policy steps",
        ("distill.on_policy.fraction=0.5", "distill.on_policy.max_new_tokens=8"),
    ),
    Feature(
        "cross_tokenizer",
        "cross-tokenizer",
        (
            "data.tokenizer=<bpe>",
            "teacher.tokenizer=bytes",
            "teacher.top_k=null",
            "student.model.vocab_size=320",
        ),
    ),  # fmt: skip
    Feature(
        "chat",
        "chat data",
        ('data.source="{stdlib_chat}"', "data.format=chat", "train.seq_len=512"),
    ),
    Feature("cache", "offline cache", ("teacher.source=cache", "teacher.cache_dir=<cache>")),
    Feature("ray", "ray mode", ("pipeline.mode=ray",)),
    Feature(
        "endpoint",
        "teacher behind a server",
        (
            "teacher.source=endpoint",
            "teacher.endpoint.url=<endpoint>",
            "teacher.endpoint.api=distill",
        ),
    ),  # fmt: skip
    Feature(
        "moe_student",
        "MoE student",
        (
            "student.model.n_experts=4",
            "student.model.experts_per_token=2",
            "student.model.d_ff_expert=16",
        ),
    ),  # fmt: skip
    Feature("pretrained", "pretrained student", ("student.checkpoint=<student>",)),
    Feature("grad_accum", "gradient accumulation", ("train.grad_accum=2",)),
    Feature("microbatch", "teacher microbatches", ("teacher.microbatch=1",)),
)
NAMES = tuple(f.name for f in FEATURES)
BY_NAME = {f.name: f for f in FEATURES}

# Pairs that are not one run at all (two values of mesh.placement, or of teacher.source).
EXCLUSIVE = {frozenset({"colocated", "auto"}), frozenset({"cache", "endpoint"})}

# Pairs `distill validate` refuses: (why, in a few words; text the refusal's line holds).
REFUSED = {
    frozenset({"cp", "on_policy"}): (
        "generation does not run over a cp-split student",
        "distill.on_policy.fraction: not supported with mesh.student.cp=2",
    ),
    frozenset({"auto", "ray"}): (
        "auto chooses from the devices of one process",
        "mesh.placement: auto chooses from the devices of one process",
    ),
    frozenset({"ray", "cache"}): (
        "the cache is read in local mode; ray's teacher actors run the teacher online",
        "teacher.source: cache is read in pipeline.mode local",
    ),
    frozenset({"ray", "endpoint"}): (
        "ray mode runs its teacher in its own actors",
        "pipeline.mode: not supported with teacher.source: endpoint",
    ),
    frozenset({"on_policy", "endpoint"}): (
        "scoring the student's samples through a server is not built yet",
        "distill.on_policy.fraction: not supported with teacher.source: endpoint",
    ),
    frozenset({"cross_tokenizer", "endpoint"}): (
        "a server answers top-k log-probs; cross-tokenizer losses read the teacher's whole "
        "distribution",
        "teacher.top_k: a served teacher answers top-k log-probs",
    ),
    frozenset({"on_policy", "cache"}): (
        "the student's samples need the teacher online to score them",
        "distill.on_policy.fraction: on-policy distillation needs the teacher online",
    ),
    frozenset({"cross_tokenizer", "cache"}): (
        "the cache holds top-k outputs; a dense cross-tokenizer loss (top_k null, as here) "
        "reads the teacher's whole distribution; at a top-k the pair runs",
        "teacher.source: not supported with teacher.tokenizer=bytes",
    ),
    frozenset({"cross_tokenizer", "grad_accum"}): (
        "the aligned teacher positions are not split into microbatches yet",
        "train.grad_accum: not supported with teacher.tokenizer=bytes",
    ),
    frozenset({"pretrained", "moe_student"}): (
        "a pretrained student's shape is its config.json's (a dense checkpoint has no experts)",
        "a pretrained student's shape comes from its config.json",
    ),
}


def pairs() -> list[tuple[str, str]]:
    """Every pair of distinct features that can be one run's, in table order."""
    return [p for p in itertools.combinations(NAMES, 2) if frozenset(p) not in EXCLUSIVE]


def refusal(*names: str) -> tuple[str, str] | None:
    """(why, the text of validate's line) where the features do not compose, else None."""
    return REFUSED.get(frozenset(names))


def settings(names, files: dict[str, str]) -> list[str]:
    """The `--set` overrides of the features `names`, their `<name>` placeholders filled."""
    out = []
    for s in (s for n in names for s in BY_NAME[n].settings):
        for key, path in files.items():
            s = s.replace(f"<{key}>", path)
        out.append(s)
    return out


def markdown() -> str:
    """docs/reference/composition.md."""
    notes = {}
    lines = [
        "# Which features compose",
        "",
        "Generated by `python -m pipelines.composition` from `pipelines/composition.py`; "
        "`tests/test_composition.py` runs every pair marked ✓ (a few steps at the tests' tiny "
        "size) and checks that `distill validate` refuses every pair marked with a note, in "
        "one line, before any device work. Each feature over a split layout:",
        "",
        "| feature | settings |",
        "|---|---|",
    ]
    for f in FEATURES:
        lines.append(f"| {f.title} | {', '.join(f'`{s}`' for s in f.settings)} |")
    lines += ["", "| | " + " | ".join(f.title for f in FEATURES) + " |"]
    lines.append("|---" * (len(FEATURES) + 1) + "|")
    for a in FEATURES:
        cells = []
        for b in FEATURES:
            pair = frozenset({a.name, b.name})
            if a == b or pair in EXCLUSIVE:
                cells.append("")
            elif (why := refusal(a.name, b.name)) is not None:
                n = notes.setdefault(pair, len(notes) + 1)
                cells.append(f"✗ {n}")
            else:
                cells.append("✓")
        lines.append(f"| **{a.title}** | " + " | ".join(cells) + " |")
    lines += ["", "Refused, and why:", ""]
    for pair, n in notes.items():
        why, line = REFUSED[pair]
        names = " + ".join(BY_NAME[x].title for x in NAMES if x in pair)
        lines.append(f"{n}. {names}: {why} (`{line}`).")
    return "\n".join(lines) + "\n"


def main() -> None:
    DOC.write_text(markdown())
    print(DOC, file=sys.stderr)


if __name__ == "__main__":
    main()
