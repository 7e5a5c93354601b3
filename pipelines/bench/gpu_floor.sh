#!/usr/bin/env bash
# The GPU figures of docs/benchmarks/2026-11-27-gpu-floor.md in one run, each step under its
# own time limit, each log under $OUT. Run from the checkout's root on a machine with one
# CUDA GPU and distill's dependencies importable (an install with the cuda12/cuda13 extra,
# or the wheels carried onto a bare image and put on PYTHONPATH):
#
#   OUT=/tmp/gpu-floor bash pipelines/bench/gpu_floor.sh
#
# About 8 minutes on an H200 (most of it compiling); a step that hangs is stopped with
# SIGABRT, and PYTHONFAULTHANDLER prints where it was.
set -u
OUT=${OUT:-/tmp/gpu-floor}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
DISTILL="python3 -m pipelines.commands.cli"
ONE_GPU="--set mesh.teacher.dp=1 --set mesh.student.fsdp=1 --set data.max_bytes=1000000"
L8="pipelines/llama3-8b-to-1b.yaml $ONE_GPU"

step() {  # step NAME SECONDS COMMAND...: run it, keep its log, print its last lines
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S))"
  timeout -s ABRT "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "exit $?"
  tail -n 6 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >>"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

# issue 32: the teacher's top-64 over plain logits, MFU; the student at 4 and 8 rows, MFU
# and HFU, train.remat auto's choice; each beside its PyTorch peer
step teacher-8b 300 $DISTILL bench $L8 --role teacher --set train.batch_size=8 --repeats 5 --torch
step student-1b-4-rows 300 $DISTILL bench $L8 --role student --set train.batch_size=4 --repeats 5 --torch
step student-1b-8-rows 240 $DISTILL bench $L8 --role student --set train.batch_size=8 --repeats 5
# issue 33: the 30B-A3B-shaped MoE teacher on one GPU, 4 rows
step moe-teacher-4-rows 300 $DISTILL bench pipelines/qwen3-30b-a3b-to-1.7b.yaml --role teacher \
  --set mesh.teacher.ep=1 --set mesh.student.fsdp=1 --set data.max_bytes=1000000 \
  --set train.batch_size=4 --repeats 3
# issue 34: the quick start on one GPU (mesh.placement auto puts both roles on it)
step quickstart-one-gpu 300 $DISTILL run pipelines/quickstart.yaml \
  --set train.steps=50 --set teacher.pretrain_steps=50 --set run.output_dir="$OUT/quickstart"
# the tests only a GPU runs
step pytest-gpu 300 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -m gpu -n 0 -q -p no:cacheprovider
