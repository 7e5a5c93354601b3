"""`distill COMMAND`: parse the arguments, load the config, call one function.

The console script `distill` points here. Each command is a small function in `COMMANDS`.
The config is read before JAX is imported, so that on a host without accelerators the
right number of simulated CPU devices can be requested first.
"""

from __future__ import annotations

import argparse
import logging
import sys

from distill.config import Config
from distill.config.load import load_config
from distill.errors import RUN_FAILED, DistillError, RunFailed
from distill.observability.metrics_log import dumps

USAGE = """Distil a large teacher model into a smaller student: one YAML file says the
models, the data, the devices of each and the loss."""
EXAMPLES = """start here:
  distill run pipelines/quickstart.yaml       train a tiny student, no downloads (minutes on a CPU)
  distill validate my.yaml                    the checks `run` makes, before any device work
  distill plan my.yaml                        the device split, memory per device and FLOPs
  distill dashboard runs/quickstart           the run's live dashboard

`distill COMMAND --help` for a command's options; `--set KEY.PATH=VALUE` overrides any
config field (docs/reference/config.md lists them). Exit status: 0 done, 2 bad input
(one line naming the field, file or record), 3 the run failed (its last good checkpoint
kept)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distill",
        description=USAGE,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    helps = {
        "run": "run a distillation pipeline",
        "validate": "make run's checks (config, data, teacher, device fit); compiles, runs nothing",
        "plan": "print the device split, sizes and FLOPs",
        "eval": "evaluate teacher and latest student checkpoint; prints one JSON object",
        "bench": "time each phase and the pipelined step; prints one JSON object last",
        "cache-teacher": "store top-k teacher outputs for teacher.source cache; one JSON line",
        "prepare": "tokenise and pack the corpus into data.prepared_dir once; one JSON line",
        "score": "print a model's mean NLL and perplexity on a text file (one document)",
        "serve": "serve the teacher over HTTP (completions API, binary top-k) for students",
    }
    for name, text in helps.items():
        c = sub.add_parser(name, help=text, description=text)
        c.add_argument("config", help="pipeline YAML file")
        c.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY.PATH=VALUE",
            help="override a config field (repeatable), e.g. --set train.steps=50",
        )
    _bench_arguments(sub.choices["bench"])
    _serve_arguments(sub.choices["serve"])
    sub.choices["cache-teacher"].add_argument(
        "--batches-per-shard", type=int, default=64, metavar="N", help="records per shard"
    )
    sub.choices["prepare"].add_argument(
        "--rows-per-shard", type=int, default=None, metavar="N", help="rows per shard"
    )
    sc = sub.choices["score"]
    sc.add_argument("--file", required=True, metavar="TEXT", help="a UTF-8 text file")
    sc.add_argument(
        "--model",
        choices=["teacher", "student"],
        default="teacher",
        help="student: the run's latest checkpoint, else its initial weights",
    )
    sc.add_argument(
        "--json", action="store_true", help="one object: tokens and each next token's log-prob"
    )
    e = sub.add_parser("export", help="write a run's latest student checkpoint as a model dir")
    e.add_argument("output_dir", help="the run's output_dir (config.yaml and checkpoints/)")
    e.add_argument(
        "--format", choices=["hf"], default="hf", help="hf: Hugging Face, the student's family"
    )
    e.add_argument("--out", default=None, help="destination (default: OUTPUT_DIR/hf)")
    e.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="the weights' dtype"
    )
    e.add_argument(
        "--max-shard-gb", type=float, default=5.0, metavar="GB",
        help="weights past this many GB are written as shards with model.safetensors.index.json",
    )  # fmt: skip
    g = sub.add_parser(
        "generate", help="print samples from a run's latest student checkpoint (or teacher)"
    )
    g.add_argument("output_dir", help="the run's output_dir (config.yaml and checkpoints/)")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    g.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--teacher", action="store_true", help="sample from the run's teacher")
    g.add_argument("--json", action="store_true", help="one JSON object per sample")
    g.add_argument(
        "--chat", action="store_true", help="each prompt is a user message through the template"
    )
    g.add_argument("--system", default=None, metavar="TEXT", help="--chat: a system message")
    text = "serve the dashboard of a run directory (or name the running run's own server)"
    d = sub.add_parser("dashboard", help=text, description=text)
    d.add_argument("output_dir", help="the run's output_dir (metrics.jsonl)")
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=None, help="default: 8080 if free, else any")
    return p


def _bench_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--repeats", type=int, default=10, help="timed repeats per measurement (median)")
    b.add_argument(
        "--http",
        type=int,
        default=0,
        metavar="N",
        help="also time the loop while a second process sends N status/metrics requests",
    )
    b.add_argument(
        "--ray", action="store_true", help="also time the ray-mode pipeline on the same config"
    )
    b.add_argument(
        "--on-policy",
        action="store_true",
        help="also time generation, scoring and the on-policy step (always when "
        "distill.on_policy.fraction > 0)",
    )
    b.add_argument(
        "--cache",
        action="store_true",
        help="also write a teacher cache and time offline training from it",
    )
    b.add_argument(
        "--colocated",
        action="store_true",
        help="also time the loop split (as configured) and colocated on the same devices, "
        "beside the tokens/s mesh.placement: auto predicts for each",
    )
    b.add_argument(
        "--role",
        choices=["teacher", "student"],
        default=None,
        help="time one role alone on this host's first devices (its configured mesh; random "
        "weights and teacher outputs): for a host too small for both, such as one GPU",
    )
    b.add_argument(
        "--placement",
        action="store_true",
        help="time every role layout mesh.placement: auto compares, each role alone on this "
        "host's devices, and store the times for auto (instead of its compiled predictions)",
    )
    b.add_argument(
        "--torch",
        action="store_true",
        help="also time a plain PyTorch + transformers KD loop on the same shapes (with --role: "
        "that role's PyTorch peer on torch's cuda:0, else the CPU; needs .[hf])",
    )


def _serve_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: every one)")
    s.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    s.add_argument(
        "--batch-rows", type=int, default=None, metavar="N",
        help="rows per teacher forward (default train.batch_size)",
    )  # fmt: skip
    s.add_argument(
        "--wait-ms", type=float, default=5.0, metavar="MS",
        help="how long a batch's first request waits for others to join it",
    )  # fmt: skip
    s.add_argument(
        "--max-len", type=int, default=None, metavar="N",
        help="longest prompt served, in tokens (default 4096)",
    )  # fmt: skip


def _prepare_devices(cfg: Config) -> None:
    """Before JAX starts: the simulated CPU devices the meshes need, and on CPU devices host
    memory kept for reuse between steps (`distill.allocator`)."""
    from distill.allocator import keep_freed_memory, runs_on_cpu
    from distill.mesh import cpu_devices_to_simulate, simulate_cpu_devices

    simulate_cpu_devices(cpu_devices_to_simulate(cfg))
    if runs_on_cpu(cfg.mesh.platform):
        keep_freed_memory()


def _config(args: argparse.Namespace) -> Config:
    """The command's config, with simulated CPU devices requested before JAX starts."""
    cfg = load_config(args.config, args.overrides)
    _prepare_devices(cfg)
    return cfg


def cmd_dashboard(args: argparse.Namespace) -> None:
    from distill.observability.server import serve_dashboard

    serve_dashboard(args.output_dir, host=args.host, port=args.port)


def cmd_export(args: argparse.Namespace) -> None:
    from student.export import export_hf

    cfg = load_config(f"{args.output_dir}/config.yaml")
    cfg.run.output_dir = args.output_dir  # the run may have moved since
    if args.max_shard_gb <= 0:
        raise DistillError(f"export --max-shard-gb: {args.max_shard_gb} must be positive")
    shard = int(args.max_shard_gb * 10**9)
    out = export_hf(cfg, args.out, dtype=args.dtype, max_shard_bytes=shard)
    print(dumps({"export": str(out), "format": args.format, "dtype": args.dtype}))


def cmd_generate(args: argparse.Namespace) -> None:
    cfg = load_config(f"{args.output_dir}/config.yaml")
    cfg.run.output_dir = args.output_dir  # the run may have moved since
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise DistillError("--max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    _prepare_devices(cfg)
    from pipelines.commands.generate import generate_text

    samples = generate_text(
        cfg,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        teacher=args.teacher,
        seed=args.seed,
        chat=args.chat,
        system=args.system,
    )
    for s in samples:
        text = s["completion"] if args.chat else s["prompt"] + s["completion"]
        print(dumps(s) if args.json else f"--- {s['model']}, {s['tokens']} tokens\n{text}")


def cmd_score(args: argparse.Namespace) -> None:
    from pipelines.commands.score import score

    result = score(_config(args), args.file, args.model)
    if args.json:
        print(dumps(result))
    else:
        n = len(result["logprobs"])
        print(
            f"{result['model']}: {n} tokens, mean NLL {result['nll']:.4f} nats, "
            f"perplexity {result['perplexity']:.3f}"
        )


def cmd_validate(args: argparse.Namespace) -> None:
    from pipelines.commands import run

    unavailable: list[str] = []  # what stops a run on this machine, not the config
    cfg, meshes, corpus = run.check_run(_config(args), unavailable)  # what `run` checks
    t, s = cfg.mesh.teacher, cfg.mesh.student
    stages = f"pp={t.pp} x " if t.pp > 1 else ""
    experts = f"ep={t.ep} x " if t.ep > 1 else ""
    t_cp, s_cp = f"cp={t.cp} x " if t.cp > 1 else "", f" x cp={s.cp}" if s.cp > 1 else ""
    print(
        f"{args.config}: ok ({corpus.train_rows} train rows, {corpus.eval_rows} eval "
        f"rows; teacher {stages}dp={t.dp} x {experts}{t_cp}tp={t.tp}, "
        f"student dp={s.dp} x fsdp={s.fsdp}{s_cp}, {meshes.platform})"
    )
    for line in unavailable:  # the line `distill run` stops at here, said now
        print(f"{args.config}: not runnable on this machine: {line}")


def cmd_plan(args: argparse.Namespace) -> None:
    from pipelines.commands import run

    print(run.plan_json(_config(args)))


def cmd_eval(args: argparse.Namespace) -> None:
    from pipelines.commands import run

    print(dumps(run.evaluate(_config(args))))


def cmd_bench(args: argparse.Namespace) -> None:
    from pipelines.bench.phases import bench, format_bench
    from pipelines.commands import run

    cfg = _config(args)
    if args.placement:
        _bench_placement(cfg, args)
        return
    if args.role:
        _bench_role(cfg, args)
        return
    meshes, corpus = run.validate(cfg)
    result = bench(
        cfg,
        corpus,
        meshes,
        repeats=args.repeats,
        http_requests=args.http,
        ray_mode=args.ray,
        cache_mode=args.cache,
        torch_mode=args.torch,
    )
    text = format_bench(result)
    if args.on_policy or cfg.distill.on_policy.fraction > 0:
        from pipelines.bench.on_policy import bench_on_policy, format_on_policy

        result.update(bench_on_policy(cfg, corpus, meshes, repeats=args.repeats))
        text += "\n" + format_on_policy(result)
    if args.colocated:
        from pipelines.bench.placements import bench_colocated, format_layouts

        result.update(bench_colocated(cfg, corpus, repeats=args.repeats))
        text += "\n" + format_layouts(result["placements"])
    print(text)
    print(dumps(result))


def _bench_role(cfg, args: argparse.Namespace) -> None:
    from pipelines.bench.role import bench_role, format_role

    flags = ("ray", "cache", "on_policy", "http", "colocated")
    both = [f"--{n}" for n in flags if getattr(args, n)]
    if both:
        raise DistillError(
            f"--role: times one role alone; {', '.join(both).replace('_', '-')} needs both"
        )
    result = bench_role(cfg, args.role, repeats=args.repeats, torch_mode=args.torch)
    print(format_role(result))
    print(dumps(result))


def _bench_placement(cfg, args: argparse.Namespace) -> None:
    from pipelines.bench.measured import bench_placement, format_placement

    flags = ("role", "ray", "cache", "on_policy", "http", "colocated", "torch")
    others = [f"--{n}" for n in flags if getattr(args, n)]
    if others:
        raise DistillError(
            f"--placement: times each candidate's roles alone; not with "
            f"{', '.join(others).replace('_', '-')}"
        )
    result = bench_placement(cfg, args.repeats)
    print(format_placement(result))
    print(dumps(result))


def cmd_cache_teacher(args: argparse.Namespace) -> None:
    from pipelines.offline.cache_writer import cache_teacher

    print(dumps(cache_teacher(_config(args), args.batches_per_shard)))


def cmd_prepare(args: argparse.Namespace) -> None:
    from pipelines.commands.prepare import prepare

    print(dumps(prepare(_config(args), args.rows_per_shard)))


def cmd_serve(args: argparse.Namespace) -> None:
    from pipelines.commands.serve import serve

    if args.batch_rows is not None and args.batch_rows < 1 or args.wait_ms < 0:
        raise DistillError("--batch-rows >= 1 and --wait-ms >= 0")
    if args.max_len is not None and args.max_len < 2 or not 0 <= args.port <= 65535:
        raise DistillError("--max-len >= 2 and 0 <= --port <= 65535")
    serve(_config(args), args.host, args.port, args.batch_rows, args.wait_ms, args.max_len)


def cmd_run(args: argparse.Namespace) -> None:
    from pipelines.commands import run

    cfg = _config(args)
    summary = run.run(cfg)
    out = {"summary": f"{cfg.run.output_dir}/summary.json", "final_eval": summary.get("final_eval")}
    print(dumps(out))
    if summary.get("failure"):
        raise RunFailed(summary["failure"])


COMMANDS = {
    "run": cmd_run,
    "validate": cmd_validate,
    "plan": cmd_plan,
    "eval": cmd_eval,
    "bench": cmd_bench,
    "cache-teacher": cmd_cache_teacher,
    "prepare": cmd_prepare,
    "export": cmd_export,
    "generate": cmd_generate,
    "score": cmd_score,
    "serve": cmd_serve,
    "dashboard": cmd_dashboard,
}


def print_error(e: DistillError | RunFailed) -> None:
    """A user's mistake, or a run that failed, as the CLI shows it: `distill: error: ...`
    lines on stderr."""
    for line in str(e).splitlines() or [""]:
        print(f"distill: error: {line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("absl", "jax", "orbax", "etils", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = _parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
        return 0
    except DistillError as e:
        print_error(e)
        return 2
    except RunFailed as e:
        print_error(e)
        return RUN_FAILED


if __name__ == "__main__":
    sys.exit(main())
