"""The tutorial (docs/guides/tutorial.md) walked as a user walks it, at tiny size.

Every `distill` line of the page's bash blocks runs through the CLI as written, in a
directory laid out as the page lays it out (`models/Qwen3-8B`, `models/Qwen3-1.7B`,
`models/Qwen3-0.6B`, `data/chat.jsonl`, the shipped `pipelines/`), with `--set` overrides
of the sizes appended to the commands that take a config (and `--repeats 2` to `bench`);
the page's Python block then loads the export in transformers and generates. The models
are tiny random Qwen3 models saved by transformers with a BPE tokenizer and Qwen3's chat
template as the model ships it; only `hf download` (no network here) is replaced by
writing them. The commands come from the page, so the page and the test cannot drift
apart.
"""

import json
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from pipelines.commands.cli import main
from tests.test_chat import train_bpe, write_model_dir
from tests.test_chat_templates import FAMILIES, REASONING, SPECIALS

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "tutorial.md"
# The tutorial's pipelines: they name model directories a user downloads, so they are
# validated here with tiny ones (tests/test_bad_input.py skips them).
PIPELINES = ("qwen3-8b-to-1.7b-chat.yaml", "qwen3-0.6b-laptop-chat.yaml")
# Validated with tiny stand-ins of their downloads elsewhere (tests/test_qwen35_counts.py;
# the served teacher's config, which `distill serve` reads: tests/test_endpoint.py).
WITH_DOWNLOADS = ("qwen3.5-35b-a3b-to-4b-chat.yaml", "qwen3-8b-served.yaml")
SMALL = [  # every config-taking command: tiny shapes, few steps, no fixed port
    "train.steps=4", "train.batch_size=8", "train.seq_len=64", "train.grad_accum=1",
    "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=4",
    "optim.warmup_steps=1", "data.eval_fraction=0.25", "data.eval_batches=1",
    "teacher.top_k=8", "server.port=0",
]  # fmt: skip
SIZES = {"qwen3-0.6b-laptop-chat.yaml": ["student.model.n_layers=2"]}
TINY = dict(  # Qwen3 as the real ones: head_dim explicit, query/key norms, 151,936 -> 384
    vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
    max_position_embeddings=512,
)  # fmt: skip


def page_commands(page: Path = PAGE) -> list[list[str]]:
    """The `distill` lines of the page's bash blocks, as argument lists, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.M | re.S)
    lines = [line.strip() for b in blocks for line in b.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("distill ")]


def page_python(page: Path = PAGE) -> str:
    (block,) = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.M | re.S)
    return block


def _save_qwen3(path: Path, bpe: Path, layers: int, tied: bool) -> None:
    import torch
    import transformers

    torch.manual_seed(layers)
    cfg = transformers.Qwen3Config(**TINY, num_hidden_layers=layers, tie_word_embeddings=tied)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(str(path))
    write_model_dir(path, bpe, *FAMILIES["qwen3"])


def _conversations(n: int) -> list[dict]:
    words = "the teacher holds a large model and the student learns its answers".split()
    out = []
    for i in range(n):
        q = " ".join(words[(i + j) % len(words)] for j in range(3 + i % 4))
        a = " ".join(words[(2 * i + j) % len(words)] for j in range(4 + i % 6))
        turn = [{"role": "user", "content": q + "?"}, {"role": "assistant", "content": a}]
        out.append({"messages": REASONING if i % 7 == 0 else turn})
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory as the tutorial lays one out, with tiny models in place of the real."""
    root = tmp_path_factory.mktemp("tutorial")
    texts = [m["content"] for c in _conversations(20) for m in c["messages"]] * 10
    bpe = root / "bpe.json"
    train_bpe(texts, SPECIALS, 320).save(str(bpe))
    _save_qwen3(root / "models" / "Qwen3-8B", bpe, layers=4, tied=False)
    _save_qwen3(root / "models" / "Qwen3-1.7B", bpe, layers=2, tied=True)
    _save_qwen3(root / "models" / "Qwen3-0.6B", bpe, layers=4, tied=True)
    (root / "data").mkdir()
    lines = (json.dumps(c) + "\n" for c in _conversations(160))
    (root / "data" / "chat.jsonl").write_text("".join(lines))
    (root / "pipelines").symlink_to(ROOT / "pipelines")
    return root


def _with_sizes(args: list[str]) -> list[str]:
    config = next((a for a in args[1:] if a.endswith(".yaml")), None)
    if config is None:
        return args
    sets = SMALL + SIZES.get(Path(config).name, [])
    repeats = ["--repeats", "2"] if args[0] == "bench" else []  # a median of 2 timings
    return [*args, *repeats, *(x for s in sets for x in ("--set", s))]


def _dashboard(args: list[str], cwd: Path) -> dict:
    """Run `distill dashboard` as the page writes it (on a free port), read its status API."""
    cmd = [sys.executable, "-m", "pipelines.commands.cli", *args, "--port", "0"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = re.search(r"(http://\S+)", proc.stdout.readline())[1]
        with urllib.request.urlopen(url.rstrip("/") + "/api/status", timeout=30) as r:
            return json.load(r)
    finally:
        proc.kill()
        proc.wait()


def test_page_names_the_shipped_pipelines():
    commands = page_commands()
    configs = {Path(a).name for c in commands for a in c if a.endswith(".yaml")}
    assert configs == set(PIPELINES)
    assert {c[0] for c in commands} >= {
        "validate", "plan", "bench", "run", "dashboard", "eval", "generate", "export",
    }  # fmt: skip


def test_every_command_of_the_tutorial(workdir, monkeypatch, capsys):
    """Each `distill` line of the page, in order, then the page's Python on the export."""
    monkeypatch.chdir(workdir)
    out = workdir / "runs" / "qwen3-8b-to-1.7b-chat"
    for args in page_commands():
        if args[0] == "dashboard":
            status = _dashboard(args, workdir)
            assert status["step"] == 4, status
            continue
        code = main(_with_sizes(args))
        printed = capsys.readouterr()
        assert code == 0, (args, printed.err[-2000:])
        text = printed.out
        if args[0] == "validate":
            assert ": ok (" in text
        elif args[0] == "plan":
            plan = json.loads(text[text.index("{") :])
            assert plan["student"]["peak_bytes_per_device"] > 0
            assert plan["host_memory"]["needed_bytes"] > 0
        elif args[0] == "eval":
            result = json.loads(text.strip().splitlines()[-1])
            assert result["student_loss"] > 0 and 0 <= result["top1_agreement"] <= 1
        elif args[0] == "generate":
            assert "--- student" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 4
    laptop = json.loads((workdir / "runs/qwen3-0.6b-laptop-chat/summary.json").read_text())
    assert laptop["completed"]
    hf = json.loads((out / "hf" / "config.json").read_text())
    assert hf["model_type"] == "qwen3" and hf["num_hidden_layers"] == 2
    printed = {}
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.setdefault("text", a))
    exec(compile(page_python(), str(PAGE), "exec"), {})  # noqa: S102 (the page's own code)
    assert isinstance(printed["text"][0], str)
