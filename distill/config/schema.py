"""One typed config tree, validated at the door; the schema only, without I/O.

Configs are made by `distill.config.load` (YAML file + `--set key.path=value` overrides,
the teacher's format and a Hugging Face teacher's shape resolved there). Every section
forbids unknown keys. The key paths (``run.output_dir``, ``mesh.teacher.tp``,
``teacher.model.d_model``, ...) are the public contract used by docs, scripts and ``--set``.
The student's model is the teacher's schema with overrides (``student.model.*``).
"""

from __future__ import annotations

from typing import Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, model_validator

from distill.config import pruning
from distill.config.data import DataConfig
from distill.config.endpoint import EndpointConfig
from distill.config.loss import DistillLossConfig
from distill.config.model import (
    DTYPE_DOC,
    RUNTIME_KEYS,
    DType,
    ModelConfig,
    Section,
)
from distill.config.student_model import StudentModelOverrides, student_fields
from distill.errors import DistillError, error_lines


class RunConfig(Section):
    name: str = Field("distill", description="Run name, shown in logs and the dashboard.")
    output_dir: str = Field(
        "runs/distill",
        description="Where every output of the run lives: a local directory or a gs:// URI "
        "(needs the gcs extra).",
    )
    seed: int = Field(0, description="Seed for parameter init and data shuffling.")
    allow_teacher_change: bool = Field(
        False,
        description="Resume, eval or export a student whose checkpoint was distilled with "
        "another teacher or tokenizer than the config's (refused by default).",
    )
    tensorboard: bool = Field(
        True,
        description="Write TensorBoard event files of the run's metrics under "
        "<run.output_dir>/tensorboard.",
    )


class TeacherMesh(Section):
    dp: int = Field(
        1,
        ge=1,
        description="Data-parallel degree of the inference mesh (dp x tp devices): the "
        "teacher's batch split over dp groups of tp devices, its weights replicated over dp.",
    )
    ep: int = Field(
        1,
        ge=1,
        description="Expert-parallel degree of the inference mesh (dp x ep x tp devices): a "
        "mixture of experts' experts split over ep, tokens sent to their experts' devices and "
        "back (all-to-all); attention data-parallel over ep. Divides teacher.model.n_experts.",
    )
    tp: int = Field(1, ge=1, description="Tensor-parallel degree of the inference mesh.")
    pp: int = Field(
        1,
        ge=1,
        description="Pipeline stages of the inference mesh (pp x dp x ep x tp devices): stage "
        "s holds layers [s*L/pp, (s+1)*L/pp) (divides teacher.model.n_layers); the "
        "teacher.microbatch microbatches stream through the stages, each stage's activations "
        "sent to the next (bubble (pp-1)/(m+pp-1) with m microbatches). Placement split, "
        "colocated or auto (which keeps the stages); in ray mode with hosts = pp each stage "
        "is a host "
        "(docs/guides/pipeline-parallel.md).",
    )
    cp: int = Field(
        1,
        ge=1,
        description="Context-parallel degree of the inference mesh (dp x ep x cp x tp "
        "devices), as mesh.student.cp's: rows split over cp in 2 x cp load-balanced chunks, "
        "ring attention, the outputs leaving split by position as a student of the same cp "
        "takes them (across tokenizers: over the teacher's own rows, then gathered at the "
        "student's positions when mesh.student.cp > 1). Local and ray mode (where it may "
        "cross the group's hosts; mesh.placement auto keeps it); not yet with "
        "mesh.teacher.pp or on-policy.",
    )
    hosts: int = Field(1, ge=1, description="Processes (hosts) of each teacher replica; ray mode.")
    devices: list[int] | None = Field(
        None,
        description="Explicit device ids for the teacher (dp x tp of them); default: the "
        "first dp x tp.",
    )


class StudentMesh(Section):
    dp: int = Field(1, ge=1, description="Data-parallel degree of the training mesh.")
    fsdp: int = Field(
        1,
        ge=1,
        description="Fully sharded data-parallel degree of the training mesh (dp x fsdp "
        "devices): parameters, gradients and optimizer state split over fsdp (ZeRO-3), the "
        "batch over both axes.",
    )
    cp: int = Field(
        1,
        ge=1,
        description="Context-parallel degree of the training mesh (dp x fsdp x cp devices): "
        "each row's sequence split over cp devices in 2 x cp load-balanced chunks, attention "
        "passing key/value blocks around the cp ring (ring attention), activations per "
        "device about 1/cp. train.seq_len must divide by 2 x cp. Local and ray mode (a row's "
        "cp devices in one process: mesh.student.hosts dividing dp x fsdp), across tokenizers "
        "too, under mesh.placement auto (which keeps it); not yet with on-policy or "
        "distill.cross_tokenizer byte_path.",
    )
    hosts: int = Field(1, ge=1, description="Processes (hosts) of the student group; ray mode.")
    devices: list[int] | None = Field(
        None,
        description="Explicit device ids for the student (dp x fsdp x cp of them); default: "
        "the next dp x fsdp x cp (the first with mesh.placement: colocated).",
    )


class MeshConfig(Section):
    teacher: TeacherMesh = Field(default_factory=TeacherMesh)
    student: StudentMesh = Field(default_factory=StudentMesh)
    platform: Literal["auto", "cpu", "gpu", "tpu"] = Field(
        "auto", description="Device platform. auto: accelerators if present, else simulated CPU."
    )
    placement: Literal["split", "colocated", "auto"] = Field(
        "split",
        description="Where the two meshes lie. split: on disjoint devices (the teacher the "
        "first dp x ep x tp, the student the next dp x fsdp), working at once. colocated: "
        "both from the first device on (the same devices when their sizes agree), the "
        "teacher's forward and the student's step in turn. auto: the layout predicted fastest "
        "on the devices present among colocated and every split the divisibility rules allow, "
        "keeping every mesh axis written (in the YAML or by --set; auto chooses the others, "
        "and a written axis no layout can keep is refused in one line); `distill plan` "
        "prints the table.",
    )


class TeacherConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    checkpoint: str | None = Field(
        None,
        description="Teacher weights: an Orbax checkpoint dir written by distill, or a local "
        "Hugging Face Llama dir (config.json + *.safetensors).",
    )
    format: Literal["auto", "distill", "hf"] = Field(
        "auto",
        description="Checkpoint format. auto: hf if teacher.checkpoint is a local directory "
        "holding a config.json, else distill; resolved when the config is loaded (the run's "
        "config.yaml records which). With hf, teacher.model is read from config.json (keys set "
        "here must agree with it).",
    )
    dtype: DType = Field("auto", description=DTYPE_DOC)
    top_k: int | None = Field(
        None,
        ge=1,
        description="Send only the top-k log-probs per token; None: dense (in one array per "
        "train.grad_accum microbatch where one a device would reach 2^31 elements).",
    )
    tokenizer: str | None = Field(
        None,
        description="The teacher's tokenizer, as data.tokenizer names one; None: data.tokenizer "
        "(one vocabulary). Another tokenizer makes the run cross-tokenizer: each row's text is "
        "tokenised by both, the teacher runs on its own tokens, and distill.cross_tokenizer "
        "compares the two vocabularies (docs/guides/cross-tokenizer.md).",
    )
    chat_template: str | None = Field(
        None,
        description="Chat data across tokenizers (a teacher.tokenizer of its own): the teacher's "
        "Jinja chat template file; None: the one saved beside teacher.tokenizer. Each side "
        "renders the conversations with its own template.",
    )
    microbatch: int | None = Field(
        None,
        ge=1,
        description="Rows per teacher forward in each mesh.teacher.dp group: the group's rows "
        "of a batch run this many at a time (peak memory bounded by one microbatch); None: all "
        "at once.",
    )
    moe_capacity_factor: float | None = Field(
        None,
        gt=0,
        description="A mixture-of-experts teacher's per-expert capacity, as a multiple of an "
        "even share of each device's tokens: assignments past it are dropped (lowest router "
        "probability first) for throughput, so the student's target is no longer the model's "
        "own. None: dropless, exact.",
    )
    moe_allow_ungrouped: bool = Field(
        False,
        description="A mixture-of-experts teacher whose compiled forward at mesh.teacher.ep=1 "
        "does over 1.5x its active FLOPs (its expert matmuls not grouped on this platform, "
        "every expert run on every token) runs anyway, with a logged warning; false: refused "
        "before anything is loaded.",
    )
    pretrain_steps: int = Field(
        0, ge=0, description="If the checkpoint is missing, train the teacher this long first."
    )
    pretrain_lr: float = Field(3e-3, gt=0, description="Peak learning rate for the bootstrap.")
    rebootstrap: bool = Field(
        False,
        description="Bootstrap the teacher again (teacher.pretrain_steps) over the one "
        "distill bootstrapped at teacher.checkpoint; a run whose settings differ from those "
        "it recorded is refused otherwise.",
    )
    replicas: int = Field(
        1, ge=1, description="Teacher actors in pipeline.mode ray, each with its own dp x tp mesh."
    )
    source: Literal["online", "cache", "endpoint"] = Field(
        "online",
        description="online: run the teacher during training. cache: read its top-k outputs "
        "from teacher.cache_dir, written by `distill cache-teacher` (no teacher on any device). "
        "endpoint: ask a server for them (teacher.endpoint: vLLM, SGLang, llama.cpp or distill "
        "serve; no teacher on any device; docs/guides/teacher-endpoint.md).",
    )
    endpoint: EndpointConfig | None = Field(
        None, description="The server of teacher.source: endpoint; None: no server."
    )
    cache_dir: str | None = Field(
        None,
        description="Where cache-teacher writes and source cache reads; default "
        "<run.output_dir>/teacher_cache.",
    )

    def loaded(self) -> bool:
        """Whether a run trains from a teacher it loads itself (online), rather than from
        outputs made elsewhere (the cache, a server)."""
        return self.source == "online"

    def is_hf(self) -> bool:
        """Whether `checkpoint` is read as a Hugging Face directory. The loader
        (`distill.config.load`) resolves `auto` to `hf` or `distill`."""
        return self.format == "hf"


class TeacherEntry(TeacherConfig):
    """One of several teachers (`teachers:`): a whole teacher section, named."""

    name: str = Field(
        ...,
        min_length=1,
        description="The teacher's name: what data.teacher_field's values say to route a "
        "record to it, and its key in the records, the dashboard and /metrics.",
    )
    weight: float = Field(
        1.0,
        gt=0,
        description="Without data.teacher_field: its share of the mixture (the weights are "
        "normalised to sum to 1). With it: not read.",
    )


class StudentConfig(Section):
    model: StudentModelOverrides = Field(default_factory=StudentModelOverrides)
    dtype: DType = Field("auto", description=DTYPE_DOC)
    init: Literal["random", "from_teacher"] = Field(
        "random",
        description="random: fresh weights. from_teacher: the teacher's embeddings, final norm, "
        "head and a subset of its layers (depth pruning); the student keeps the teacher's width. "
        "Ignored with student.checkpoint.",
    )
    checkpoint: str | None = Field(
        None,
        description="A pretrained student's local Hugging Face directory (any supported "
        "family): its starting weights, and student.model from its config.json (keys set here "
        "must agree). Shares data.tokenizer; a resume starts from the run's own checkpoint.",
    )
    _pretrained: ModelConfig | None = PrivateAttr(None)  # config.json's, set by the loader
    init_layers: list[int] | None = Field(
        None,
        description="from_teacher: the teacher layers to keep, increasing; default: "
        "student.model.n_layers of them evenly spaced, the first and last included.",
    )


class OptimConfig(Section):
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (AdamW).")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor / peak.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (not on norms).")
    b1: float = Field(0.9, ge=0, lt=1, description="Adam first-moment decay.")
    b2: float = Field(0.95, ge=0, lt=1, description="Adam second-moment decay.")
    clip_norm: float | None = Field(1.0, gt=0, description="Global-norm gradient clipping.")


class TrainConfig(Section):
    steps: int = Field(100, ge=1, description="Student training steps.")
    batch_size: int = Field(16, ge=1, description="Global batch size (sequences).")
    seq_len: int = Field(128, ge=2, description="Tokens per packed row.")
    log_every: int = Field(10, ge=1, description="Steps between metric records.")
    eval_every: int = Field(100, ge=1, description="Steps between evaluations.")
    checkpoint_every: int = Field(100, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(3, ge=1, description="How many checkpoints to keep.")
    metrics_lag: int = Field(2, ge=1, description="Read step n-lag's metrics at step n.")
    min_free_host_memory_gib: float = Field(
        1.0,
        ge=0,
        description="The run stops (exit status 3) when the host memory still available "
        "(MemAvailable, or the container's cgroup limit) falls below this many GiB after a "
        "step, before the kernel's out-of-memory killer would end the process: its newest "
        "checkpoint is kept and nothing of the state then is written (a save needs host "
        "memory too). The summary records the process's peak resident memory. 0: not watched.",
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description="A step whose loss or gradient norm is not finite leaves the weights as "
        "they were; after this many such steps in a row the run stops (exit status 3) "
        "without a final checkpoint, its newest checkpoint the last finite one.",
    )
    grad_accum: int = Field(
        1,
        ge=1,
        description="Gradient accumulation: each device's rows of a step run as this many "
        "microbatches, their gradients summed (float32) before one optimizer update; the loss "
        "is the one of the whole batch. train.batch_size must divide by dp x fsdp x grad_accum.",
    )
    remat: Literal["auto", "none", "dots", "block"] = Field(
        "auto",
        description="Rematerialisation of the student's blocks in the backward pass, by "
        "increasing recompute. none: keep every activation; dots: keep the matmul outputs, "
        "recompute attention and elementwise ops; block: keep only each block's input, "
        "recompute the rest; auto: the first of these whose compiled step fits the device's "
        "memory less 10% headroom (`distill plan` shows each one's peak), none on CPU.",
    )
    layer_loop: Literal["auto", "scan", "unroll"] = Field(
        "auto",
        description="The training step's layers. scan: one block looped over the stacked layers "
        "(compile time independent of depth); unroll: each layer its own code, no stacked "
        "activations to read back (faster on CPU); auto: unroll up to 8 layers on CPU, else scan.",
    )
    profile: list[int] | None = Field(
        None,
        description="[first_step, steps]: write a jax.profiler trace of these training steps "
        "to <run.output_dir>/profile (TensorBoard's profile plugin or Perfetto); None: off.",
    )

    @model_validator(mode="after")
    def _profile(self) -> TrainConfig:
        if self.profile is not None and (
            len(self.profile) != 2 or self.profile[0] < 1 or self.profile[1] < 1
        ):
            raise ValueError(f"profile: {self.profile} must be [first_step >= 1, steps >= 1]")
        return self


class PipelineConfig(Section):
    mode: Literal["local", "ray"] = Field(
        "local",
        description="local: one process, two meshes. ray: teacher and student Ray actors, "
        "each owning its devices (see the ray section).",
    )
    prefetch: int = Field(2, ge=1, description="Teacher outputs in flight at most.")
    max_staleness: int = Field(
        1,
        ge=0,
        description="On-policy: the continuations trained on at step n are generated with "
        "the student's parameters after step n-1-max_staleness, so generation, teacher "
        "scoring and training overlap; 0: strictly on-policy, no overlap. pipeline.prefetch "
        "must not exceed max_staleness + 1.",
    )


class RayConfig(Section):
    address: str | None = Field(
        None, description="Ray cluster to join (e.g. 'auto', 'ray://head:10001'); None: start one."
    )
    max_teacher_restarts: int = Field(
        3, ge=0, description="Teacher actor deaths survived (each recreated) before the run fails."
    )
    max_student_restarts: int = Field(
        2, ge=0, description="Student actor deaths survived (each resumed from its checkpoint)."
    )


class ServerConfig(Section):
    enabled: bool = Field(True, description="Serve the status API and dashboard.")
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8080, ge=0, le=65535, description="Port; 0 picks a free one.")
    token: str | None = Field(
        None, description="Bearer token enabling POST control endpoints (or DISTILL_SERVER_TOKEN)."
    )
    stall_timeout_s: float = Field(
        300.0, gt=0, description="/healthz turns 503 when no step finished for this long."
    )


class WandbConfig(Section):
    """Weights & Biases logging of the run's metrics (the wandb extra)."""

    enabled: bool = Field(False, description="Log the run's metrics to W&B.")
    project: str | None = Field(None, description="W&B project; None: WANDB_PROJECT or W&B's.")
    entity: str | None = Field(None, description="W&B entity (user or team); None: the default.")
    mode: Literal["online", "offline"] | None = Field(
        None, description="online, or offline (sync later: `wandb sync`); None: WANDB_MODE."
    )
    name: str | None = Field(None, description="W&B run name; default run.name.")
    group: str | None = Field(None, description="W&B run group.")
    tags: list[str] = Field(default_factory=list, description="W&B run tags.")
    id: str | None = Field(
        None, description="W&B run id; set it to continue one W&B run across resumed runs."
    )


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    teachers: list[TeacherEntry] = Field(
        default_factory=list,
        description="Several teachers for one student (docs/guides/several-teachers.md), each "
        "a whole teacher section with a name: each record goes to the one its "
        "data.teacher_field names, or, without that field, the divergence is to all of them, "
        "weighted. The first is also `teacher` (the student's shape, from_teacher, the plan's "
        "layout). Empty: the one `teacher`.",
    )
    student: StudentConfig = Field(default_factory=StudentConfig)
    data: DataConfig
    distill: DistillLossConfig = Field(default_factory=DistillLossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    def each_teacher(self) -> list[Config]:
        """One config per teacher, whose `teacher` is that one (`teachers`), else [self]."""
        if not self.teachers:
            return [self]
        return [self.model_copy(update={"teacher": t}) for t in self.teachers]

    def teacher_weights(self) -> tuple[float, ...]:
        """The teachers' mixture weights, summing to 1 (one teacher: (1.0,))."""
        w = [t.weight for t in self.teachers] or [1.0]
        return tuple(x / sum(w) for x in w)

    def cross_tokenizer(self) -> bool:
        """Whether the teacher has its own tokenizer (teacher.tokenizer, unlike data.tokenizer)."""
        return self.teacher.tokenizer not in (None, self.data.tokenizer)

    def student_model(self) -> ModelConfig:
        """The teacher's model schema with the student's overrides applied (dense unless
        they set experts or the student starts from the teacher's layers:
        `student_fields`; per-layer keys from the layers it keeps: `pruning`);
        a pretrained
        student's (`student.checkpoint`) is its config.json's, with only the runtime keys
        (`RUNTIME_KEYS`) taken from the overrides."""
        overrides = self.student.model.model_dump(exclude_none=True)
        pretrained = self.student._pretrained
        if pretrained is not None:
            runtime = {k: overrides[k] for k in RUNTIME_KEYS if k in overrides}
            merged = {**pretrained.model_dump(), **runtime}
        else:
            keep = self.student.init == "from_teacher"
            merged = student_fields(self.teacher.model, overrides, keep_experts=keep)
            t, chosen = self.teacher.model, self.student.init_layers
            merged.update(pruning.kept_layer_fields(t, overrides, keep, chosen))
        try:
            return ModelConfig(**merged)
        except ValidationError as e:
            lines = error_lines(e, prefix="student.model", model=ModelConfig)
            raise DistillError("\n".join(lines)) from None

    def vocab_sizes(self) -> tuple[int, ...]:  # equal, or differing by padding
        """The model vocabulary sizes over data.tokenizer's ids: (teacher's, student's), or
        the student's alone when the teacher has its own tokenizer (cross-tokenizer)."""
        if self.cross_tokenizer():
            return (self.student_model().vocab_size,)
        return self.teacher.model.vocab_size, self.student_model().vocab_size

    def init_layers(self) -> list[int]:
        """The teacher layers a `from_teacher` student starts from (validated)."""
        t, chosen = self.teacher.model, self.student.init_layers
        return pruning.init_layers(t, self.student_model(), chosen)

    def resolve_dtypes(self, platform: str) -> None:
        """Set `auto` compute dtypes for the platform the meshes are on: bfloat16 on
        accelerators, float32 on CPU (where bfloat16 matmuls are emulated and slow)."""
        for role in (self.teacher, *self.teachers, self.student):
            if role.dtype == "auto":
                role.dtype = "float32" if platform == "cpu" else "bfloat16"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
