"""Benchmark: load a generated, sharded Hugging Face checkpoint into the TP layout.

    python -m teacher.load_bench [--gb 1.0] [--shard-gb 0.25] [--tp 4] [--dir DIR]

Writes a random bfloat16 Llama checkpoint of about `--gb` GB in safetensors shards of at
most `--shard-gb` GB (with the index file, as `save_pretrained` writes them), then loads it
with `teacher.hf.load_hf_teacher` onto a `tp`-device mesh in a fresh process and reports
the load time, and the process's peak resident memory above its level just before the load,
sampled every millisecond and split into the loaded weights themselves (on CPU devices they
live in host memory), the mapped safetensors pages, and other transient memory: the cost of
loading, to compare with the largest shard. Prints one JSON
object last. On CPU the devices are simulated (`XLA_FLAGS`), so device count and host
memory are those of this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from distill.observability.metrics_log import dumps


def bench_config(gb: float):
    """A Llama-7B-shaped layer (narrowed to d_model 2048) stack of about `gb` GB in bf16."""
    from distill.config import ModelConfig

    base = dict(vocab_size=32000, d_model=2048, n_heads=16, n_kv_heads=4, d_ff=5632)
    per_layer = 2 * (2048 * (2048 + 2 * 512 + 2048) + 3 * 2048 * 5632 + 2 * 2048)
    top = 2 * (2 * 32000 * 2048 + 2048)
    n_layers = max(1, round((gb * 1e9 - top) / per_layer))
    return ModelConfig(**base, n_layers=n_layers)


def write_checkpoint(path: Path, cfg, shard_bytes: int) -> dict:
    """Random bf16 tensors in shards of at most `shard_bytes`; returns sizes in bytes."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from distill.models import hf
    from distill.models.hf import export as hf_config

    path.mkdir(parents=True, exist_ok=True)
    config = hf_config.to_hf_config(cfg, max_position_embeddings=4096, bos_id=1, eos_id=2)
    (path / hf.CONFIG).write_text(dumps(config, indent=2))
    rng = np.random.default_rng(0)
    shards, current, size = [], {}, 0
    for name, (key, _, _) in hf.weight_names(cfg).items():
        shape = hf.hf_shape(cfg, key)
        t = (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
        if current and size + t.nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.nbytes
    shards.append(current)
    weight_map, total, largest = {}, 0, 0
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        nbytes = sum(t.nbytes for t in tensors.values())
        total, largest = total + nbytes, max(largest, nbytes)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / hf.INDEX_FILE).write_text(dumps(index, indent=2))
    return {"checkpoint_bytes": total, "largest_shard_bytes": largest, "shards": len(shards)}


def _rss() -> dict[str, int]:
    """Resident bytes of this process: anonymous (heap; on CPU also the "device" buffers)
    and file-backed (mapped safetensors pages)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class _PeakSampler(threading.Thread):
    """Samples `_rss()` every millisecond; `peak` holds the maxima of each part and of
    their sum."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0, "RssFile": 0, "total": 0}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.001):
            r = _rss()
            r["total"] = r["RssAnon"] + r["RssFile"]
            self.peak = {k: max(v, r[k]) for k, v in self.peak.items()}

    def stop(self) -> dict[str, int]:
        self._stop_event.set()
        self.join()
        return self.peak


def load_child(path: str, tp: int) -> dict:
    """In this (fresh) process: time one load onto `tp` devices and measure memory."""
    import jax

    from distill.mesh import teacher_mesh
    from distill.models import hf
    from teacher.hf import load_hf_teacher

    cfg = hf.read_model_config(path)
    mesh = teacher_mesh(jax.devices()[:tp], 1, tp)
    jax.block_until_ready(jax.device_put(np.zeros(4), jax.devices()[0]))  # runtime up
    before = _rss()
    sampler = _PeakSampler()
    sampler.start()
    t0 = time.perf_counter()
    params = jax.block_until_ready(load_hf_teacher(path, cfg, mesh))
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    on_devices = sum(x.nbytes for x in jax.tree.leaves(params))
    anon = peak["RssAnon"] - before["RssAnon"]
    return {
        "load_s": seconds,
        "device_bytes": on_devices,
        "peak_rss_above_start_bytes": peak["total"] - before["RssAnon"] - before["RssFile"],
        "peak_mapped_file_bytes": peak["RssFile"] - before["RssFile"],
        "peak_anon_beyond_weights_bytes": anon - on_devices,
        "platform": jax.devices()[0].platform,
        "tp": tp,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="checkpoint size (GB)")
    ap.add_argument("--shard-gb", type=float, default=0.25, help="largest shard (GB)")
    ap.add_argument("--tp", type=int, default=4, help="tensor-parallel devices")
    ap.add_argument("--dir", default=None, help="where to write it (default: a temp dir)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(dumps(load_child(args.child, args.tp)))
        return 0
    with tempfile.TemporaryDirectory(prefix="distill-load-bench-", dir=args.dir) as tmp:
        cfg = bench_config(args.gb)
        t0 = time.perf_counter()
        sizes = write_checkpoint(Path(tmp), cfg, int(args.shard_gb * 1e9))
        write_s = time.perf_counter() - t0
        env = dict(os.environ)
        if "--xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
            flag = f"--xla_force_host_platform_device_count={args.tp}"
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
        cmd = [sys.executable, "-m", "teacher.load_bench", "--tp", str(args.tp), "--child", tmp]
        child = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if child.returncode:
            sys.stderr.write(child.stderr)
            return child.returncode
        result = {
            **sizes,
            "n_layers": cfg.n_layers,
            "write_s": write_s,
            **json.loads(child.stdout.strip().splitlines()[-1]),
        }
    gb = 1e-9
    print(
        f"checkpoint {result['checkpoint_bytes'] * gb:.2f} GB in {result['shards']} shards "
        f"(largest {result['largest_shard_bytes'] * gb:.2f} GB), tp={result['tp']} on "
        f"{result['platform']}: loaded in {result['load_s']:.2f} s "
        f"({result['checkpoint_bytes'] * gb / result['load_s']:.2f} GB/s); peak host memory "
        f"above the start {result['peak_rss_above_start_bytes'] * gb:.2f} GB: the weights "
        f"{result['device_bytes'] * gb:.2f} GB (on CPU devices, host memory), mapped "
        f"safetensors pages at most {result['peak_mapped_file_bytes'] * gb:.2f} GB, other "
        f"transient memory at most {result['peak_anon_beyond_weights_bytes'] * gb:.2f} GB"
    )
    print(dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
