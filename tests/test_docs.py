"""The docs: generated references match their sources, every relative link resolves, no
page reads as a development log, and the install page's commands are CI's and the
container's."""

import re
import sys
from pathlib import Path

import pytest

from distill.config import reference as config_ref
from distill.models.families import reference as families_ref
from pipelines.commands import reference as cli_ref

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "deploy" / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize(
    ("module", "path"),
    [
        (config_ref.config_reference, "docs/reference/config.md"),
        (cli_ref.cli_reference, "docs/reference/cli.md"),
        (families_ref.families_reference, "docs/reference/families.md"),
    ],
    ids=["config", "cli", "families"],
)
def test_generated_reference_is_current(module, path):
    fresh = module()
    committed = (ROOT / path).read_text() if (ROOT / path).exists() else ""
    command = sys.modules[module.__module__].COMMAND
    assert committed == fresh, f"{path} is stale: regenerate it with `{command}`"


def test_the_config_reference_writer_takes_help_and_a_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        config_ref.main(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # nothing written, no file named --help
    assert config_ref.main([str(tmp_path / "ref.md")]) == 0
    assert (tmp_path / "ref.md").read_text() == config_ref.config_reference()


def _without_fences(text: str) -> str:
    return re.sub(r"^(```|~~~).*?^\1\s*$", "", text, flags=re.M | re.S)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where links are links."""
    return re.sub(r"`[^`\n]*`", "", _without_fences(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page, with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in _without_fences(page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_follows_github():
    assert slug("`distill run`") == "distill-run"
    assert slug("Memory at real sizes") == "memory-at-real-sizes"
    assert slug("`mesh.teacher`") == "meshteacher"
    assert slug("TensorBoard and W&B") == "tensorboard-and-wb"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_docs_exist_and_are_indexed():
    index = (ROOT / "docs" / "README.md").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        rel = page.relative_to(ROOT / "docs").as_posix()
        if rel != "README.md":
            assert f"({rel})" in index or f"({rel}#" in index, f"docs/README.md misses {rel}"


_LOG_PHRASES = (
    "this session",
    "re-?checked",
    "the day before",
    "earlier that day",
    "same session",
    "last check",
    "last session",
)
LOG_WORDING = re.compile(
    "|".join(p.replace(" ", r"\s+") for p in _LOG_PHRASES)  # also across a line break
    + r"|\((?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\)",  # a commit hash in brackets
    re.I,
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_log(page):
    hits = [m[0] for m in LOG_WORDING.finditer(page.read_text())]
    assert not hits, f"{page.relative_to(ROOT)} reads as a log: {hits}"


# -- guides say what is true now -----------------------------------------------------------

GUIDES = sorted(
    [ROOT / "README.md", ROOT / "docs" / "architecture.md", *(ROOT / "docs").glob("*.md")]
    + [*(ROOT / "docs" / "guides").glob("*.md")]
)
# A measurement: a date, or a time or a rate with its figure. Those belong on a dated
# benchmark page (docs/benchmarks/), which a guide links to.
MEASUREMENT = re.compile(
    r"\b20\d\d-\d\d-\d\d\b|\b\d[\d,.]*\s?(?:ms|tok/s|tokens/s)\b|\b\d[\d,.]*\s?s on a\b"
)
# A claim that a feature is missing.
MISSING = re.compile(
    r"not (?:yet )?supported|not done yet|\bnot yet\b|\bunsupported\b|not implemented", re.I
)
SOURCES = "\n".join(
    p.read_text()
    for d in ("distill", "teacher", "student", "pipelines")
    for p in (ROOT / d).rglob("*.py")
)


def _paragraphs(text: str) -> list[str]:
    """Paragraphs and list items of a page's text outside fenced code, link targets dropped."""
    text = re.sub(r"\]\([^)]*\)", "]", _without_fences(text))
    return [p for p in re.split(r"\n\s*\n|\n(?=\s*[-*] |\s*\d+\. )", text) if p.strip()]


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_guides_hold_no_measurements(page):
    text = page.read_text()
    if page.name == "README.md" and page.parent == ROOT:
        # the front page's quick-start figures (the shipped pipeline's own output) and the
        # test command's time are what a reader comes for
        for heading in ("### What the quick start shows", "## Tests"):
            start = text.index(heading)
            end = text.find("\n## ", start + len(heading))
            text = text[:start] + (text[end:] if end != -1 else "")
    hits = [m[0] for p in _paragraphs(text) for m in MEASUREMENT.finditer(p)]
    assert not hits, (
        f"{page.relative_to(ROOT)} holds measurements {hits}: put them on a dated page in "
        "docs/benchmarks/ and link to it"
    )


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_missing_features_name_the_refusal(page):
    """A claim that something is missing names, in inline code, a fragment of what the code
    does instead (the refusal's message or key, as the source spells it): when the feature
    lands and the refusal goes, the claim fails here rather than going stale."""
    stale = []
    for para in _paragraphs(page.read_text()):
        if not MISSING.search(para):
            continue
        spans = re.findall(r"`([^`\n]+)`", para)
        if not any(s in SOURCES for s in spans):
            stale.append(" ".join(para.split())[:120])
    assert not stale, f"{page.relative_to(ROOT)}: a missing feature with no refusal named: {stale}"


# -- the install page's commands are CI's and the container's ------------------------------


def test_install_page_runs_what_ci_and_the_container_install():
    """docs/install.md (and the README) give .ci/run's own test line; every extra its pip
    lines name is a pyproject group; an accelerator extra pins the same jax as the
    container's requirements for that ACCELERATOR; its `docker build` names real ones."""
    import importlib.util
    import tomllib

    page, readme = (ROOT / "docs" / "install.md").read_text(), (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("pip install") and ci in page and ci in readme
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = project["optional-dependencies"]
    spec = importlib.util.spec_from_file_location("ir", ROOT / "deploy" / "image_requirements.py")
    image = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(image)
    named = {e for m in re.findall(r"pip install[^\n]*?-e \"?\.\[([^\]]+)\]", page)
             for e in m.split(",")}  # fmt: skip
    assert {"cuda12", "cuda13", "tpu", "test", "hf", "ray"} <= named <= set(groups)
    for accelerator in ("cuda12", "cuda13", "tpu"):
        (container_jax,) = [r for r in image.requirements(project, accelerator) if "jax[" in r]
        assert groups[accelerator] == [container_jax], accelerator
    (build,) = re.findall(r"^docker build .*$", page, flags=re.M)
    accelerator = re.search(r"ACCELERATOR=(\S+)", build)[1]
    extras = re.search(r"EXTRAS=\"([^\"]*)\"", build)[1].split()
    assert accelerator in image.ACCELERATORS and set(extras) <= set(groups)
