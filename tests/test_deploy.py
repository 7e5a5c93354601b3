"""The container image and the pod launch files: parsed and cross-checked.

Default run: every YAML under deploy/ parses; kinds, apiVersions, images, commands, config
mounts, ports, probes and accelerator resources agree with each other, with the Dockerfile
and with the CLI's config schema; each RayJob has one worker group per role whose pods
hold that role's processes (one per pod, dp x tp / hosts devices each, marked by the
role's custom Ray resource). Slow: deploy/container_smoke.sh builds the cpu image with
buildah and runs a short pipeline in it.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
GPU = DEPLOY / "gpu" / "rayjob.yaml"
TPU = DEPLOY / "tpu" / "jobset.yaml"
TPU_RAY = DEPLOY / "tpu" / "rayjob.yaml"
ACCELERATOR_RESOURCE = {"gpu": "nvidia.com/gpu", "tpu": "google.com/tpu"}
SERVER_PORT = 8080
HEALTHZ = f"http://127.0.0.1:{SERVER_PORT}/healthz"


# ---------------------------------------------------------------------------- helpers


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _walk(node, key: str):
    """Every value stored under `key` anywhere in a parsed YAML tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v, key)


def _containers(doc: dict) -> list[dict]:
    return [c for cs in _walk(doc, "containers") for c in cs]


def _set_overrides(argv: list[str]) -> dict[str, str]:
    """`--set k=v` pairs of a command line, as a dict."""
    out = {}
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == "--set":
            k, v = value.split("=", 1)
            out[k] = v
    return out


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if not buf and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        lines.append(buf + raw)
        buf = ""
    out = []
    for line in lines:
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _final_stage() -> list[tuple[str, str]]:
    ins = _dockerfile()
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last_from:]


def _readme_build_extras(accelerator: str) -> set[str]:
    """The EXTRAS of deploy/README.md's `docker build` commands for `accelerator`."""
    extras = set()
    for line in (DEPLOY / "README.md").read_text().splitlines():
        if line.startswith("docker build") and f"ACCELERATOR={accelerator} " in line:
            m = re.search(r"EXTRAS=(\"[^\"]*\"|\S+)", line)
            extras |= set(m[1].strip('"').replace(",", " ").split()) if m else set()
    return extras


def _image_requirements():
    spec = importlib.util.spec_from_file_location(
        "image_requirements", DEPLOY / "image_requirements.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Launch:
    """What one manifest launches: the pod running `distill run` and its command line."""

    def __init__(self, path: Path):
        self.docs = _docs(path)
        self.configmaps = {d["metadata"]["name"]: d for d in self.docs if d["kind"] == "ConfigMap"}
        self.pvcs = {
            d["metadata"]["name"] for d in self.docs if d["kind"] == "PersistentVolumeClaim"
        }
        self.service = _one(self.docs, "Service")
        if any(d["kind"] == "RayJob" for d in self.docs):
            job = _one(self.docs, "RayJob")
            self.argv = shlex.split(job["spec"]["entrypoint"])
            # the driver runs on the head pod
            self.pod = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
        else:
            job = _one(self.docs, "JobSet")
            (rjob,) = job["spec"]["replicatedJobs"]
            self.pod = rjob["template"]["spec"]["template"]
            self.argv = self.pod["spec"]["containers"][0]["command"]
        self.job = job
        self.container = self.pod["spec"]["containers"][0]
        self.sets = _set_overrides(self.argv)

    def volume(self, mount_path_prefix: str) -> dict:
        """The pod volume whose mount holds `mount_path_prefix`."""
        for m in self.container.get("volumeMounts", []):
            mp = m["mountPath"].rstrip("/") + "/"
            if mount_path_prefix.startswith(mp):
                (vol,) = [v for v in self.pod["spec"]["volumes"] if v["name"] == m["name"]]
                return vol
        raise AssertionError(f"nothing mounted at {mount_path_prefix} in {self.container['name']}")

    def volume_names(self) -> set[str]:
        return {v["name"] for v in self.pod["spec"].get("volumes", [])}

    def config_text(self) -> str:
        path = self.argv[2]
        vol = self.volume(path)
        assert "configMap" in vol, f"{path} is not on a ConfigMap volume"
        cm = self.configmaps[vol["configMap"]["name"]]
        return cm["data"][Path(path).name]

    def port(self, name_or_number) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        (p,) = [p for p in self.container["ports"] if p.get("name") == name_or_number]
        return p["containerPort"]

    def platform(self) -> str:
        """The accelerator of the manifest's image tag: gpu (cuda12) or tpu."""
        return "gpu" if self.container["image"].endswith(":cuda12") else "tpu"

    def config(self, tmp_path: Path):
        """The ConfigMap's config with the command line's overrides, as the CLI loads it."""
        from distill.config.load import load_config

        cfg_file = tmp_path / "config.yaml"
        cfg_file.write_text(self.config_text())
        return load_config(cfg_file, [f"{k}={v}" for k, v in self.sets.items()])


LAUNCHES = {"gpu": GPU, "tpu": TPU, "tpu-ray": TPU_RAY}
RAYJOBS = {"gpu": GPU, "tpu-ray": TPU_RAY}


@pytest.fixture(scope="module", params=sorted(LAUNCHES))
def launch(request) -> _Launch:
    return _Launch(LAUNCHES[request.param])


# ---------------------------------------------------------------------------- manifests


def test_every_yaml_under_deploy_parses_into_k8s_objects():
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert GPU in files and TPU in files and TPU_RAY in files
    for f in files:
        docs = _docs(f)
        assert docs, f"{f}: no documents"
        for d in docs:
            for field in ("apiVersion", "kind", "metadata"):
                assert field in d, f"{f}: a document without {field}"
            assert d["metadata"].get("name"), f"{f}: a {d['kind']} without metadata.name"


def test_kinds_and_api_versions():
    want = {
        GPU: {
            "ConfigMap": "v1",
            "PersistentVolumeClaim": "v1",
            "RayJob": "ray.io/v1",
            "Service": "v1",
        },
        TPU: {
            "ConfigMap": "v1",
            "ServiceAccount": "v1",
            "JobSet": "jobset.x-k8s.io/v1alpha2",
            "Service": "v1",
        },
        TPU_RAY: {
            "ConfigMap": "v1",
            "ServiceAccount": "v1",
            "RayJob": "ray.io/v1",
            "Service": "v1",
        },
    }
    for path, kinds in want.items():
        got = {d["kind"]: d["apiVersion"] for d in _docs(path)}
        assert got == kinds, path


def test_images_are_one_repository_tagged_by_accelerator():
    accelerators = set(_image_requirements().ACCELERATORS)
    repos = set()
    for path, tag in ((GPU, "cuda12"), (TPU, "tpu"), (TPU_RAY, "tpu")):
        assert tag in accelerators
        for doc in _docs(path):
            for image in _walk(doc, "image"):
                repo, _, got = image.rpartition(":")
                assert got == tag, f"{path}: {image} is not the ACCELERATOR={tag} image"
                repos.add(repo)
    assert len(repos) == 1, f"manifests name different images: {repos}"
    assert repos.pop().endswith("/distill")


def test_command_runs_distill_on_a_config_from_the_configmap(launch):
    assert launch.argv[:2] == ["distill", "run"]
    assert launch.config_text().strip()
    if launch.job["kind"] == "RayJob":
        # the driver joins the KubeRay cluster (ray.address None would start its own)
        assert launch.sets["pipeline.mode"] == "ray"
        assert launch.sets["ray.address"] == "auto"


def test_output_dir_is_on_a_persistent_volume_or_in_a_bucket(launch):
    out = launch.sets["run.output_dir"]
    if out.startswith("gs://"):
        # every pod that writes outputs has a declared service account (Workload Identity:
        # no key files), and the image the README builds for it carries gcsfs
        accounts = {d["metadata"]["name"] for d in launch.docs if d["kind"] == "ServiceAccount"}
        pods = [launch.pod]
        if launch.job["kind"] == "RayJob":  # the student actor checkpoints from a worker
            groups = launch.job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
            pods += [g["template"] for g in groups]
        for pod in pods:
            assert pod["spec"].get("serviceAccountName") in accounts
        assert not launch.pvcs and not launch.volume_names() - {"config", "shm"}
        accelerator = launch.container["image"].rpartition(":")[2]
        assert "gcs" in _readme_build_extras(accelerator), accelerator
        return
    vol = launch.volume(out)
    assert vol["persistentVolumeClaim"]["claimName"] in launch.pvcs
    if launch.job["kind"] == "RayJob":  # the student actor checkpoints from a worker
        claim = vol["persistentVolumeClaim"]["claimName"]
        pvc = [d for d in launch.docs if d["kind"] == "PersistentVolumeClaim"][0]
        assert "ReadWriteMany" in pvc["spec"]["accessModes"]
        for group in launch.job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
            spec = group["template"]["spec"]
            names = {
                v["name"]
                for v in spec["volumes"]
                if v.get("persistentVolumeClaim", {}).get("claimName") == claim
            }
            mounts = {
                m["mountPath"] for m in spec["containers"][0]["volumeMounts"] if m["name"] in names
            }
            assert any(out.startswith(m.rstrip("/") + "/") for m in mounts)


def test_configmap_config_is_valid_for_the_cli(launch, tmp_path):
    """The config validates as `distill validate` checks it before touching devices or data:
    the schema, the model shapes against the meshes, the mode (hosts), on-policy keys."""
    from pipelines.on_policy import check_on_policy
    from pipelines.preflight import check_mode, check_shapes

    cfg = launch.config(tmp_path)
    check_shapes(cfg)
    check_mode(cfg)
    check_on_policy(cfg)
    assert cfg.server.host == "0.0.0.0"
    assert cfg.server.port == SERVER_PORT
    assert cfg.server.enabled
    assert cfg.mesh.platform == launch.platform()


def test_ports_service_and_dockerfile_agree(launch):
    exposed = [rest for word, rest in _final_stage() if word == "EXPOSE"]
    assert exposed == [str(SERVER_PORT)]
    assert launch.sets["server.port"] == str(SERVER_PORT)
    assert launch.port("distill-http") == SERVER_PORT
    svc = launch.service["spec"]
    (http,) = [p for p in svc["ports"] if p["name"] == "http"]
    assert http["port"] == SERVER_PORT and launch.port(http["targetPort"]) == SERVER_PORT
    labels = launch.pod["metadata"]["labels"]
    assert svc["selector"].items() <= labels.items(), "the Service selects no driver pod"


def test_probes_hit_healthz_on_the_server_port(launch):
    c = launch.container
    if launch.job["kind"] == "JobSet":
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/healthz", probe
            assert launch.port(get["port"]) == SERVER_PORT, probe
    else:
        # the RayJob head: readiness is Ray's own (the job starts once the head is ready);
        # liveness adds the driver's /healthz
        assert HEALTHZ not in " ".join(c["readinessProbe"]["exec"]["command"])
        assert HEALTHZ in " ".join(c["livenessProbe"]["exec"]["command"])
    healthcheck = [rest for word, rest in _final_stage() if word == "HEALTHCHECK"]
    assert len(healthcheck) == 1 and HEALTHZ in healthcheck[0]


def test_pods_run_as_the_image_user(launch):
    (user,) = [rest for word, rest in _final_stage() if word == "USER"]
    uid = int(user.split(":")[0])
    pods = [launch.pod]
    if launch.job["kind"] == "RayJob":
        pods += [g["template"] for g in launch.job["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
    for pod in pods:
        sc = pod["spec"]["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == uid and sc["fsGroup"] == uid


def _host_resources(group: dict) -> dict:
    """The custom Ray resources a worker group's pods offer (`ray start --resources`, whose
    value KubeRay passes through a shell: a quoted JSON object)."""
    value = group.get("rayStartParams", {}).get("resources")
    return json.loads(shlex.split(value)[0]) if value else {}


@pytest.mark.parametrize("name", sorted(RAYJOBS))
def test_ray_worker_groups_hold_each_role_group(name, tmp_path):
    """One worker group per role, its pods marked by the role's custom Ray resource (what
    the actors' placement asks for); one process per pod, each pod holding the devices of
    one process (mesh size / hosts); as many pods as the role has processes. A TPU group is
    whole multi-host slices: numOfHosts = hosts, chips per host x hosts = the topology."""
    pytest.importorskip("ray")
    from distill.mesh import devices_per_host, hosts
    from pipelines.ray.actors import HOST_RESOURCES

    launch = _Launch(RAYJOBS[name])
    cfg = launch.config(tmp_path)
    spec = launch.job["spec"]["rayClusterSpec"]
    accelerator = ACCELERATOR_RESOURCE[launch.platform()]
    assert accelerator not in json.dumps(launch.container.get("resources", {}))
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # the driver only
    for role, resource in HOST_RESOURCES.items():
        (group,) = [g for g in spec["workerGroupSpecs"] if resource in _host_resources(g)]
        assert _host_resources(group) == {resource: 1}, "one process of the role per pod"
        (c,) = group["template"]["spec"]["containers"]
        per_pod = int(c["resources"]["limits"][accelerator])
        assert int(c["resources"]["requests"][accelerator]) == per_pod
        assert per_pod == devices_per_host(cfg, role), (role, per_pod)
        per_replica = group.get("numOfHosts", 1)
        groups = cfg.teacher.replicas if role == "teacher" else 1
        assert group["replicas"] * per_replica == hosts(cfg, role) * groups, role
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
        if launch.platform() == "tpu":
            assert per_replica == hosts(cfg, role), "a TPU group is one whole slice"
            topology = group["template"]["spec"]["nodeSelector"]
            chips = math.prod(
                int(n) for n in topology["cloud.google.com/gke-tpu-topology"].split("x")
            )
            assert chips == per_pod * per_replica
        # KubeRay's default probes need wget, which the image lacks
        assert "exec" in c["readinessProbe"] and "exec" in c["livenessProbe"]


def test_tpu_slice_selectors_and_chips_match_the_mesh(tmp_path):
    """The JobSet runs local mode: one process on one single-host slice, both meshes on
    its chips (multi-host slices run in tpu/rayjob.yaml)."""
    launch = _Launch(TPU)
    spec = launch.pod["spec"]
    sel = spec["nodeSelector"]
    assert sel["cloud.google.com/gke-tpu-accelerator"]
    topology = sel["cloud.google.com/gke-tpu-topology"]
    chips = math.prod(int(n) for n in topology.split("x"))
    limits = launch.container["resources"]["limits"]
    per_host = int(limits["google.com/tpu"])
    (rjob,) = launch.job["spec"]["replicatedJobs"]
    hosts = rjob["template"]["spec"]["parallelism"]
    assert per_host * hosts == chips == rjob["template"]["spec"]["completions"] * per_host
    cfg = launch.config(tmp_path)
    assert cfg.pipeline.mode == "local" and hosts == 1
    assert cfg.mesh.teacher.hosts == cfg.mesh.student.hosts == 1
    assert cfg.mesh.teacher.tp * cfg.mesh.teacher.dp + cfg.mesh.student.dp <= per_host


# ------------------------------------------------ the RayJob head's liveness probe, executed


class _Fake(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(b"success" if self.status == 200 else b"stalled")

    def log_message(self, *args):
        pass


def _serve(status: int) -> http.server.HTTPServer:
    handler = type("H", (_Fake,), {"status": status})
    srv = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.mark.parametrize(("healthz", "alive"), [(None, True), (200, True), (503, False)])
def test_head_liveness_probe_semantics(healthz, alive):
    """Ray up + no driver listening: alive. Driver 200: alive. Driver 503 (stall): dead."""
    script = _Launch(GPU).container["livenessProbe"]["exec"]["command"][2]
    servers = [_serve(200), _serve(200)]
    script = script.replace("127.0.0.1:52365", f"127.0.0.1:{servers[0].server_port}")
    script = script.replace("127.0.0.1:8265", f"127.0.0.1:{servers[1].server_port}")
    if healthz is None:
        free = _serve(200)
        port = free.server_port
        free.server_close()
        free.shutdown()
    else:
        servers.append(_serve(healthz))
        port = servers[-1].server_port
    script = script.replace(f"127.0.0.1:{SERVER_PORT}", f"127.0.0.1:{port}")
    try:
        rc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, timeout=30
        ).returncode
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
    assert (rc == 0) == alive


# ---------------------------------------------------------------------------- Dockerfile


def test_dockerfile_accelerator_arg_and_base():
    ins = _dockerfile()
    first_from = next(i for i, (w, _) in enumerate(ins) if w == "FROM")
    assert ("ARG", "ACCELERATOR=cpu") in ins[:first_from]
    froms = [rest.split()[0] for w, rest in ins if w == "FROM"]
    assert froms[0] == "debian:bookworm-slim"
    assert _final_stage()[0][1].split()[0] in {"debian:bookworm-slim", "base"}
    assert "python3" in ins[first_from + 1][1]  # Debian's python3 (3.11)


def test_dockerfile_runtime_contract():
    final = _final_stage()
    words = [w for w, _ in final]
    (entry,) = [rest for w, rest in final if w == "ENTRYPOINT"]
    assert json.loads(entry) == ["distill"]
    (user,) = [rest for w, rest in final if w == "USER"]
    assert user.split(":")[0] not in {"0", "root"}
    (health,) = [rest for w, rest in final if w == "HEALTHCHECK"]
    assert "/healthz" in health and "urllib" in health
    assert "curl" not in health and "wget" not in health
    assert ("WORKDIR", "/workspace") in final
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN")


def test_dockerfile_installs_dependencies_before_copying_the_source():
    ins = _dockerfile()
    copy_pyproject = next(
        i
        for i, (w, r) in enumerate(ins)
        if w == "COPY" and "pyproject.toml" in r and "--from" not in r
    )
    install_deps = next(
        i
        for i, (w, r) in enumerate(ins)
        if w == "RUN" and "pip install" in r and "requirements" in r
    )
    copy_source = next(
        i for i, (w, r) in enumerate(ins) if w == "COPY" and re.match(r"(--\S+\s+)*\.\s", r)
    )
    copy_pyproject_args = ins[copy_pyproject][1].split()
    assert "." not in copy_pyproject_args[:-1], "the dependency layer must not see the source"
    assert copy_pyproject < install_deps < copy_source
    assert re.search(r"pip install [^&]*--no-deps", " ".join(r for w, r in ins[copy_source:]))


def test_dockerfile_leaves_no_compilers_or_caches():
    ins = _dockerfile()
    for w, rest in ins:
        if w == "RUN":
            for pip in re.findall(r"pip (?:install|wheel)[^&]*", rest):
                assert "--no-cache-dir" in pip, pip
            assert not re.search(r"\b(gcc|g\+\+|build-essential|clang)\b", rest), rest
    final_runs = " ".join(rest for w, rest in _final_stage() if w == "RUN")
    assert "python3-venv" not in final_runs and "python3-dev" not in final_runs


def test_dockerignore_keeps_runs_caches_and_git_out():
    lines = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for pattern in (".git", "runs", "**/__pycache__", ".venv", ".pytest_cache", "tests"):
        assert pattern in lines, pattern
    # what the build needs stays in
    assert lines.index("!deploy/image_requirements.py") > lines.index("deploy")
    for needed in ("pyproject.toml", "README.md", "distill", "teacher", "student", "pipelines"):
        assert needed not in lines


# ---------------------------------------------------------------------------- requirements


@pytest.mark.parametrize(
    ("accelerator", "jax"),
    [
        ("cpu", "jax>=0.8"),
        ("cuda12", "jax[cuda12]>=0.8"),
        ("cuda13", "jax[cuda13]>=0.8"),
        ("tpu", "jax[tpu]>=0.8"),
    ],
)
def test_image_requirements_select_the_jax_install(accelerator, jax):
    mod = _image_requirements()
    assert mod.with_jax_extra("jax>=0.8", mod.ACCELERATORS[accelerator]) == jax
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = mod.requirements(project, accelerator)
    assert len(reqs) == len(project["dependencies"])
    jax_reqs = [r for r in reqs if re.match(r"jax\b(?![-_])", r)]
    assert len(jax_reqs) == 1
    extra = mod.ACCELERATORS[accelerator]
    assert (f"[{extra}]" in jax_reqs[0]) if extra else ("[" not in jax_reqs[0])


def test_readme_builds_name_existing_extras_and_gcs_brings_gcsfs():
    import tomllib

    mod = _image_requirements()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for accelerator in ("cuda12", "tpu"):
        extras = _readme_build_extras(accelerator)
        assert "gcs" in extras, f"the {accelerator} image cannot write to a gs:// output_dir"
        reqs = mod.requirements(project, accelerator, sorted(extras))
        assert any(re.match(r"gcsfs\b", r) for r in reqs)


def test_image_requirements_reject_unknowns():
    mod = _image_requirements()
    project = {"dependencies": ["jax>=0.8", "numpy"], "optional-dependencies": {"ray": ["ray"]}}
    assert mod.requirements(project, "cpu", ["ray"]) == ["jax>=0.8", "numpy", "ray"]
    assert mod.with_jax_extra("jaxtyping>=0.2", "tpu") == "jaxtyping>=0.2"
    assert mod.with_jax_extra("jax[k8s]>=0.8", "tpu") == "jax[k8s,tpu]>=0.8"
    with pytest.raises(ValueError, match="ACCELERATOR"):
        mod.requirements(project, "rocm")
    with pytest.raises(ValueError, match="gcs"):
        mod.requirements(project, "cpu", ["gcs"])
    assert mod.main(["--pyproject", str(ROOT / "pyproject.toml"), "--accelerator", "x"]) == 2


def test_smoke_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(DEPLOY / "container_smoke.sh")], check=True)


def test_readme_walks_from_build_to_dashboard():
    text = (DEPLOY / "README.md").read_text()
    for needed in (
        "docker build --build-arg ACCELERATOR=cuda12",
        "docker build --build-arg ACCELERATOR=tpu",
        "kubectl port-forward svc/distill-gpu-dashboard",
        "kubectl port-forward svc/distill-tpu-dashboard",
        "kubectl port-forward svc/distill-tpu-ray-dashboard",
        "deploy/tpu/rayjob.yaml",
        "numOfHosts",
        "teacher_host",
        "student_host",
        "container_smoke.sh",
        "container.sh",
        "jax.distributed.initialize",
    ):
        assert needed in text, needed


# ---------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_container_smoke():
    """Builds the cpu image and runs validate + a 4-step run inside it (minutes)."""
    if shutil.which("buildah") is None:
        pytest.skip("buildah is not installed")
    container_sh = Path(
        os.environ.get("DISTILL_CONTAINER_SH", ROOT.parent / "shared" / "tools" / "container.sh")
    )
    if not container_sh.is_file():
        pytest.skip(f"no {container_sh}")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        pytest.skip("buildah with chroot isolation needs root here")
    proc = subprocess.run(
        ["bash", str(DEPLOY / "container_smoke.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, "DISTILL_CONTAINER_SH": str(container_sh)},
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert "SMOKE OK" in proc.stdout, tail
