"""Peak host memory (RSS) of a run on CPU devices with a Qwen2.5-0.5B-shaped teacher.

    nice python -m pipelines.bench.host_memory WORKDIR [--until TEXT] [--set KEY=VALUE ...]
    nice python -m pipelines.bench.host_memory WORKDIR --command load [--set KEY=VALUE ...]

Makes, once, under WORKDIR: a Hugging Face directory of a random Qwen2.5 model with the
real 0.5B dimensions (transformers' `Qwen2Config`, saved in bfloat16 with
`save_pretrained`: 0.99 GB), a small byte-level BPE tokenizer with a ChatML template
beside it, and a chat JSONL. Then runs `distill run pipelines/qwen3-0.6b-laptop-chat.yaml`
on them (a few steps, one evaluation; `--set` overrides are passed on) as a child process,
sampling its resident memory every 50 ms: the peak, and the RSS at each line the run
prints, so the phase that holds the peak is visible. The child is killed past `--cap-gb`
(the machine is shared). `--command load` runs, in the child, only what a run loads
before its first step (`load_only`). Prints one JSON object last
(docs/benchmarks/2026-11-27-host-memory.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from distill.observability.metrics_log import dumps

CONFIG = "pipelines/qwen3-0.6b-laptop-chat.yaml"
QWEN25_05B = dict(  # Qwen/Qwen2.5-0.5B-Instruct's config.json
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)  # fmt: skip
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = "the teacher holds a large model and the student learns its answers one token at a time"


def conversations(n: int) -> list[dict]:
    words = WORDS.split()
    out = []
    for i in range(n):
        q = " ".join(words[(i + j) % len(words)] for j in range(8 + i % 5))
        a = " ".join(words[(3 * i + j) % len(words)] for j in range(20 + i % 17))
        user = {"role": "user", "content": f"Question {i}: {q}?"}
        out.append({"messages": [user, {"role": "assistant", "content": a}]})
    return out


def make_model_dir(root: Path) -> Path:
    """The checkpoint, tokenizer and data under `root`, made once."""
    model = root / "qwen2.5-0.5b-random"
    if (model / "config.json").exists():
        return model
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B, torch_dtype="bfloat16"))
    hf.to(torch.bfloat16).save_pretrained(str(model))
    del hf
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator([WORDS, "Question 0123456789?"] * 50, trainer)
    tok.save(str(model / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}  # fmt: skip
    (model / "tokenizer_config.json").write_text(dumps(config))
    lines = (dumps(c) + "\n" for c in conversations(400))
    (root / "chat.jsonl").write_text("".join(lines))
    return model


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its children (a CPU run is one process)."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


def measure(cmd: list[str], cap: int, until: str | None = None) -> dict:
    """Run `cmd`, sampling its RSS; the peak (and the last line printed before it, so the
    phase holding it is named), the RSS at each printed line, the exit code. With `until`,
    the child is killed (SIGKILL: no stop handling, whose final checkpoint would count)
    once it prints a line holding that text."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, lines, start = {"rss": 0, "after": ""}, [""], time.time()

    def seen(rss: int) -> None:
        if rss > peak["rss"]:
            peak.update(rss=rss, after=lines[-1][:100])

    def sample() -> None:
        while proc.poll() is None:
            now = rss_bytes(proc.pid)
            seen(now)
            if now > cap:
                proc.kill()
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    for line in proc.stdout:
        rss = rss_bytes(proc.pid)
        seen(rss)
        lines.append(line.rstrip())
        print(f"{time.time() - start:7.1f}s {rss / 1e9:6.2f} GB  {line.rstrip()[:150]}", flush=True)
        if until and until in line:
            proc.kill()
            break
    rc = proc.wait()
    out = {"rc": rc, "peak_rss_gb": round(peak["rss"] / 1e9, 2), "peak_after": peak["after"]}
    return {**out, "seconds": round(time.time() - start)}


def load_only(sets: list[str]) -> None:
    """The child of `--command load`: the run's config and meshes, the teacher loaded onto
    its mesh, then the student's state made from the teacher's kept layers, as `distill
    run` does before its first step (no corpus, no compile of the step); prints the peak
    RSS after each as JSON (`getrusage`)."""
    import resource

    from distill.allocator import keep_freed_memory
    from distill.config.load import load_config
    from distill.mesh import cpu_devices_to_simulate, simulate_cpu_devices

    cfg = load_config(CONFIG, sets)
    simulate_cpu_devices(cpu_devices_to_simulate(cfg))
    keep_freed_memory()
    import jax

    from distill.mesh import build_meshes
    from student import optim, train
    from teacher.weights import load_teacher, student_init_params

    peak = lambda: round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)  # noqa: E731
    meshes = build_meshes(cfg)
    cfg.resolve_dtypes(meshes.platform)
    teacher = jax.block_until_ready(load_teacher(cfg, meshes.teacher))
    after_teacher = peak()
    scfg, mesh = cfg.student_model(), meshes.student
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps)
    init = student_init_params(cfg, train.param_shardings(scfg, mesh))
    state = jax.block_until_ready(train.init_state(scfg, tx, cfg.run.seed, mesh, init))
    del init
    sizes = [x.nbytes for x in jax.tree.leaves((teacher, state))]
    out = {"peak_after_teacher_gb": after_teacher, "peak_after_student_gb": peak()}
    print(dumps({**out, "arrays_gb": round(sum(sizes) / 1e9, 2)}), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir")
    ap.add_argument("--cap-gb", type=float, default=14.0)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--command", default="run", choices=["run", "plan", "load"])
    ap.add_argument("--load-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--until", default=None, help="kill the run at a line holding this text")
    args = ap.parse_args(argv)
    if args.load_child:
        return load_only(args.set)
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    model = make_model_dir(root)
    shutil.rmtree(root / "run", ignore_errors=True)  # a fresh run, never a resume
    sets = [
        f"teacher.checkpoint={model}", f"data.tokenizer={model}",
        f"data.source={root / 'chat.jsonl'}", f"run.output_dir={root / 'run'}",
        "student.model.n_layers=4", "train.steps=6", "train.eval_every=3",
        "train.checkpoint_every=6", "train.log_every=1", "train.seq_len=128",
        "data.eval_batches=1", "server.port=0", *args.set,
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "pipelines.commands.cli", args.command, CONFIG]
    if args.command == "load":
        cmd = [sys.executable, "-m", "pipelines.bench.host_memory", str(root), "--load-child"]
    cmd += [a for s in sets for a in ("--set", s)]
    result = measure(cmd, int(args.cap_gb * 1e9), args.until)
    print(dumps({**result, "sets": args.set}))


if __name__ == "__main__":
    main()
