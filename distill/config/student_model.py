"""A student's model keys: `student.model` overrides (`StudentModelOverrides`, every
`ModelConfig` key optional) and how they combine with the teacher's (`student_fields`)."""

from __future__ import annotations

from pydantic import Field, create_model

from distill.config.model import RUNTIME_KEYS, ModelConfig
from distill.config.rope import Section
from distill.models import families

# Keys that only a mixture of experts reads, for a student made dense (`student_fields`).
MOE_KEYS = (
    "n_experts", "experts_per_token", "d_ff_expert", "norm_topk_prob", "dense_layers",
    "d_ff_shared", "shared_expert_gate", "router_score", "router_bias", "router_correction_bias",
    "n_group", "topk_group", "routed_scale", "expert_bias", "moe_beside_dense", "router_norm",
    "expert_scale",
)  # fmt: skip


def student_fields(teacher: ModelConfig, overrides: dict, keep_experts: bool) -> dict:
    """A student's model keys from its teacher's and its `student.model` overrides. The
    student is dense unless its overrides set `n_experts` or `keep_experts` (the student
    starts from the teacher's layers): an MoE teacher's experts are not inherited, its
    MoE keys take their defaults and its family becomes the dense one (Mixtral: mistral,
    Qwen2-MoE: qwen2, Qwen3-MoE: qwen3; OLMoE, which has none, stays olmoe) unless the
    overrides set one. A student of another family than both (a Qwen3 student of a
    DeepSeek-V3 or gpt-oss teacher) inherits only the runtime keys: its shape is its own,
    and the teacher's latent attention, windows or sinks are not its family's."""
    fields = teacher.model_dump()
    family = overrides.get("family")
    if family not in (None, teacher.family, families.get(teacher.family).dense):
        defaults = {k: info.default for k, info in ModelConfig.model_fields.items()}
        return {**defaults, **{k: fields[k] for k in RUNTIME_KEYS}, **overrides}
    if teacher.n_experts and not keep_experts and "n_experts" not in overrides:
        fields.update({k: ModelConfig.model_fields[k].default for k in MOE_KEYS})
        fields["family"] = families.get(teacher.family).dense or teacher.family
    return {**fields, **overrides}


def _overrides() -> type[Section]:
    """`StudentModelOverrides`: every ModelConfig key, optional, without its validation."""
    fields = {
        name: (info.annotation | None, Field(None, description=info.description))
        for name, info in ModelConfig.model_fields.items()
    }
    return create_model(
        "StudentModelOverrides",
        __base__=Section,
        __doc__="Any `teacher.model` key; unset keys inherit the teacher's value, except an "
        "MoE teacher's experts: the student is dense unless it sets n_experts (or starts "
        "from the teacher's layers, student.init: from_teacher), a student of another "
        "family (family set to neither the teacher's nor its dense counterpart), which "
        "inherits only `attention`, and the per-layer keys "
        "(layer_types, dense_layers) of a student of another depth: those of the teacher "
        "layers it keeps (student.init_layers, else evenly spaced).",
        **fields,
    )


StudentModelOverrides = _overrides()
