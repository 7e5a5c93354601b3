#!/usr/bin/env bash
# Build the cpu image with shared/tools/container.sh (buildah; no Docker engine, no registry)
# and prove it runs: image metadata, then inside one fresh container `distill validate` and a
# short `distill run` of pipelines/quickstart.yaml, with its outputs checked in place.
#
#   bash deploy/container_smoke.sh
#
# Environment:
#   DISTILL_CONTAINER_SH   path to container.sh   (default: ../shared/tools/container.sh,
#                                                  relative to the repository root)
#   DISTILL_SMOKE_TAG      image tag              (default: localhost/distill:cpu-smoke)
#   DISTILL_SMOKE_CONFIG   pipeline, relative to the image's WORKDIR /workspace
#                                                 (default: pipelines/quickstart.yaml)
#   DISTILL_SMOKE_SET      extra `--set` overrides for the run, space-separated key=value
#   DISTILL_SMOKE_EXTRAS   the image's EXTRAS build arg (default: none); with `gcs` the
#                          container also validates a gs:// run.output_dir (gcsfs is there;
#                          validation sends nothing: no bucket is reachable from here)
#
# Exits non-zero, naming the failed step, on any failure.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
CONTAINER_SH=${DISTILL_CONTAINER_SH:-../shared/tools/container.sh}
TAG=${DISTILL_SMOKE_TAG:-localhost/distill:cpu-smoke}
EXTRAS=${DISTILL_SMOKE_EXTRAS:-}
CONFIG=${DISTILL_SMOKE_CONFIG:-pipelines/quickstart.yaml}
OUT=/tmp/distill-smoke

step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { printf '\nSMOKE FAILED: %s\n' "$*" >&2; exit 1; }

[[ -f $CONTAINER_SH ]] || fail "container.sh not found at $CONTAINER_SH (set DISTILL_CONTAINER_SH)"
[[ -f Dockerfile ]] || fail "no Dockerfile in $(pwd)"

step "base image (debian:bookworm-slim, made once per machine)"
bash "$CONTAINER_SH" base || fail "base image"

step "build $TAG (ACCELERATOR=cpu EXTRAS='$EXTRAS'; --layers reuses the dependency layer)"
start=$SECONDS
# --format docker keeps the HEALTHCHECK (the OCI format has no field for it).
bash "$CONTAINER_SH" build "$TAG" --format docker --layers --build-arg ACCELERATOR=cpu \
  --build-arg "EXTRAS=$EXTRAS" || fail "image build"
echo "built in $((SECONDS - start)) s"

step "image metadata: entrypoint, user, port, healthcheck"
buildah --storage-driver vfs inspect --type image "$TAG" | python3 -c '
import json, sys
c = json.load(sys.stdin)["Docker"]["config"]
checks = {
    "ENTRYPOINT [\"distill\"]": c.get("Entrypoint") == ["distill"],
    "USER non-root": c.get("User", "") not in ("", "0", "root") and not c["User"].startswith(("0:", "root:")),
    "EXPOSE 8080": "8080/tcp" in (c.get("ExposedPorts") or {}),
    "HEALTHCHECK /healthz": "/healthz" in " ".join((c.get("Healthcheck") or {}).get("Test") or []),
    "WORKDIR /workspace": c.get("WorkingDir") == "/workspace",
}
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
sys.exit(0 if all(checks.values()) else 1)
' || fail "image metadata"
buildah --storage-driver vfs images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$TAG" || true

# `container.sh run` uses `buildah run`, which ignores ENTRYPOINT: the command is literal.
# It has no volume mounts, so the outputs are checked inside the same container.
overrides=(--set train.steps=4 --set teacher.pretrain_steps=4 --set train.log_every=1
           --set train.eval_every=2 --set train.checkpoint_every=2 --set data.max_bytes=400000
           --set run.output_dir=$OUT/run --set teacher.checkpoint=$OUT/teacher
           --set server.port=0)
for kv in ${DISTILL_SMOKE_SET:-}; do overrides+=(--set "$kv"); done
gcs_check="echo 'no gcs extra: gs:// check skipped'"
if [[ " $EXTRAS " == *" gcs "* ]]; then
  gcs_check="distill validate $CONFIG --set run.output_dir=gs://distill-smoke/run"
fi
inner=$(cat <<EOF
set -eu
echo "container: uid=\$(id -u) cwd=\$(pwd) python=\$(python --version 2>&1)"
test "\$(id -u)" != 0 || { echo "running as root"; exit 1; }
echo '--- distill --help'; distill --help >/dev/null
echo '--- bash -lc (KubeRay login shell) finds the venv'; bash -lc 'command -v distill python'
echo '--- distill validate $CONFIG'; distill validate $CONFIG
echo '--- gs:// run.output_dir (the gcs extra)'; $gcs_check
echo '--- distill run $CONFIG ${overrides[*]}'; distill run $CONFIG ${overrides[*]}
echo '--- outputs'; ls -la $OUT/run
test -s $OUT/run/metrics.jsonl || { echo "missing or empty: metrics.jsonl"; exit 1; }
test -s $OUT/run/summary.json || { echo "missing or empty: summary.json"; exit 1; }
python -c "import json; print('summary.json:', json.load(open('$OUT/run/summary.json')))"
echo "metrics.jsonl: \$(wc -l < $OUT/run/metrics.jsonl) records"
EOF
)
step "run in a fresh container: validate, run, check outputs"
start=$SECONDS
bash "$CONTAINER_SH" run "$TAG" sh -c "$inner" || fail "in-container validate/run/outputs"
echo "container run took $((SECONDS - start)) s"

step "SMOKE OK: $TAG builds, validates and runs $CONFIG"
