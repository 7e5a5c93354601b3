"""The families reference, generated from the registry: `docs/reference/families.md`.

One row per registered family (`distill.models.families`): its `model_type`, the
transformers class it exports as, the shared parts it composes beyond Llama's, a dense
student's family, and its chat template's quirks. Regenerated with
``python -m distill.models.families.reference``; a test fails when the page is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from distill.models import families

OUTPUT = Path(__file__).resolve().parents[3] / "docs" / "reference" / "families.md"
COMMAND = "python -m distill.models.families.reference"

_HEADER = f"""# Model families reference

<!-- Generated from the registry in distill/models/families/ by `{COMMAND}`; do not edit. -->

Every `model_type` a teacher or student checkpoint may have, one record each in
`distill/models/families/`. "Parts" are the shared pieces of the one decoder it composes
beyond Llama's (RoPE, grouped-query attention, SwiGLU, RMSNorm). A dense student of a
mixture of experts takes the "dense student" family; "image-text" is the `model_type` of the
released image-text checkpoints whose text model is read as this family (the vision tower
is not loaded). What each family was checked against
is in [the model-families guide](../guides/model-families.md).

| `model_type` | exports as | parts beyond Llama's | dense student | image-text | chat template |
|---|---|---|---|---|---|
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or "—"


def families_reference() -> str:
    rows = []
    for name in families.names():
        f = families.get(name)
        image = f"`{f.image_text}`" if f.image_text else ""
        cells = (
            f"`{name}`",
            f"`{f.architecture}`",
            ", ".join(f.parts),
            f.dense or "",
            image,
            f.chat,
        )
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return _HEADER + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else OUTPUT
    out.write_text(families_reference())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
