"""The config tree: its schema (`schema`, with the shared model schema in `model`) and how
a YAML file becomes a validated `Config` (`load`).

The schema's classes are importable from here: `from distill.config import Config`.
"""

from distill.config.model import (
    DTYPE_DOC,
    RUNTIME_KEYS,
    AttentionBackend,
    DType,
    ModelConfig,
    RopeScaling,
    Section,
    StudentModelOverrides,
)
from distill.config.schema import (
    Config,
    DataConfig,
    DistillLossConfig,
    MeshConfig,
    OnPolicyConfig,
    OptimConfig,
    PipelineConfig,
    RayConfig,
    RunConfig,
    ServerConfig,
    StudentConfig,
    StudentMesh,
    TeacherConfig,
    TeacherMesh,
    TrainConfig,
    WandbConfig,
)

__all__ = [
    "DTYPE_DOC",
    "RUNTIME_KEYS",
    "AttentionBackend",
    "Config",
    "DType",
    "DataConfig",
    "DistillLossConfig",
    "MeshConfig",
    "ModelConfig",
    "OnPolicyConfig",
    "OptimConfig",
    "PipelineConfig",
    "RayConfig",
    "RopeScaling",
    "RunConfig",
    "Section",
    "ServerConfig",
    "StudentConfig",
    "StudentMesh",
    "StudentModelOverrides",
    "TeacherConfig",
    "TeacherMesh",
    "TrainConfig",
    "WandbConfig",
]
