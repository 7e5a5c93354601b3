# distill: one image for every target.
#
#   docker build -t distill:cpu .                                   # CPU (default)
#   docker build --build-arg ACCELERATOR=cuda12 --build-arg EXTRAS="ray gcs" -t distill:cuda12 .
#   docker build --build-arg ACCELERATOR=tpu --build-arg EXTRAS=gcs -t distill:tpu .
#
# ACCELERATOR picks the JAX install: cpu -> jax, cuda12 -> jax[cuda12], cuda13 -> jax[cuda13]
# (CUDA, cuDNN and NCCL come as pip wheels; the node only needs an NVIDIA driver new enough
# for that CUDA: 525+ for 12, 580+ for 13), tpu -> jax[tpu] (libtpu).
# EXTRAS names [project.optional-dependencies] groups of pyproject.toml to add (e.g. ray;
# gcs: gcsfs, for a gs:// run.output_dir).
#
# Stages: base (Debian's python3) -> deps (venv with the dependencies, from pyproject.toml
# alone) -> wheel (the project's wheel, from the source) -> runtime (base + the venv, then
# the wheel installed from a bind mount; no compilers, no pip caches, no build tools). A code
# change rebuilds only the wheel and the last two layers: the dependency layer is keyed on
# pyproject.toml. RUN --mount needs BuildKit (Docker's default since 23) or buildah.
# The HEALTHCHECK is kept by `docker build`; buildah keeps it only with --format docker.

ARG ACCELERATOR=cpu

FROM debian:bookworm-slim AS base
# bookworm's python3 is 3.11, as the project requires.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb

FROM base AS deps
ARG ACCELERATOR
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip
COPY pyproject.toml deploy/image_requirements.py /build/
RUN python3 /build/image_requirements.py --pyproject /build/pyproject.toml \
      --accelerator "$ACCELERATOR" --extras "$EXTRAS" > /build/requirements.txt \
 && echo "ACCELERATOR=$ACCELERATOR EXTRAS=$EXTRAS; installing:" && cat /build/requirements.txt \
 && /opt/venv/bin/pip install --no-cache-dir -r /build/requirements.txt

FROM deps AS wheel
COPY . /src
RUN /opt/venv/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src

FROM base AS runtime
ARG ACCELERATOR
LABEL org.opencontainers.image.title="distill" \
      org.opencontainers.image.description="Knowledge distillation on two device meshes in JAX" \
      distill.accelerator="${ACCELERATOR}"
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DISTILL_ACCELERATOR=${ACCELERATOR}
# uid/gid 1000, numeric below, so Kubernetes' runAsNonRoot can verify it. Login shells
# (KubeRay starts Ray with `bash -lc`) reset PATH from /etc/profile: profile.d puts the
# venv back.
RUN groupadd --gid 1000 distill \
 && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash distill \
 && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/distill-venv.sh \
 && install -d -o 1000 -g 1000 /workspace /workspace/pipelines
COPY --from=deps /opt/venv /opt/venv
WORKDIR /workspace
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["distill"]
CMD ["--help"]
# The project itself, last: the only runtime layers a code change rebuilds. The wheel is
# bind-mounted from its stage, so it stays out of every layer. The shipped
# pipelines/*.yaml also go to /workspace/pipelines, so `distill run pipelines/quickstart.yaml`
# works from the WORKDIR.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/tmp/wheels \
    pip install --no-cache-dir --no-deps /tmp/wheels/*.whl \
 && rm -rf /root/.cache \
 && site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && if ls "$site"/pipelines/*.yaml >/dev/null 2>&1; then \
      install -m 0644 -o 1000 -g 1000 "$site"/pipelines/*.yaml /workspace/pipelines/; fi \
 && distill --help >/dev/null
USER 1000:1000
