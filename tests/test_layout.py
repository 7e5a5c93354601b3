"""The house's layout: imports run one way, and no folder grows a flat pile of modules.

`pipelines` (orchestration) may import `teacher`, `student` and `distill`; `teacher` and
`student` (one mesh each) import only `distill`, never each other; `distill` (the core both
roles share) imports none of them. Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("distill", "teacher", "student", "pipelines")
ALLOWED = {
    "distill": {"distill"},
    "teacher": {"teacher", "distill"},
    "student": {"student", "distill"},
    "pipelines": {"pipelines", "teacher", "student", "distill"},
}
MAX_FLAT_MODULES = 15


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package):
    wrong = [
        f"{path.relative_to(ROOT)} imports {sorted(found - ALLOWED[package])}"
        for path in sorted((ROOT / package).rglob("*.py"))
        if (found := _imported_packages(path)) - ALLOWED[package]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_folder_is_a_flat_pile_of_modules():
    crowded = []
    for package in PACKAGES:
        for folder in [ROOT / package, *(ROOT / package).rglob("*/")]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > MAX_FLAT_MODULES:
                crowded.append(f"{folder.relative_to(ROOT)}: {len(modules)} modules")
    assert not crowded, "group these into subpackages named by idea: " + ", ".join(crowded)
