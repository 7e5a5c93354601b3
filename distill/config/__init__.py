"""The config tree: its schema (`schema`, with the shared model schema in `model`, the
data section in `data` and the distill section in `loss`), how a YAML file becomes a
validated `Config` (`load`), and the generated reference (`reference`).

The schema's classes are importable from here: `from distill.config import Config`.
"""

from distill.config.data import DataConfig
from distill.config.endpoint import EndpointConfig
from distill.config.loss import DistillLossConfig, OnPolicyConfig
from distill.config.model import (
    DTYPE_DOC,
    RUNTIME_KEYS,
    AttentionBackend,
    DType,
    ModelConfig,
    RopeScaling,
    Section,
)
from distill.config.schema import (
    Config,
    MeshConfig,
    OptimConfig,
    PipelineConfig,
    RayConfig,
    RunConfig,
    ServerConfig,
    StudentConfig,
    StudentMesh,
    TeacherConfig,
    TeacherEntry,
    TeacherMesh,
    TrainConfig,
    WandbConfig,
)
from distill.config.student_model import StudentModelOverrides

__all__ = [
    "DTYPE_DOC",
    "RUNTIME_KEYS",
    "AttentionBackend",
    "Config",
    "DType",
    "DataConfig",
    "DistillLossConfig",
    "EndpointConfig",
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
    "TeacherEntry",
    "TeacherMesh",
    "TrainConfig",
    "WandbConfig",
]
