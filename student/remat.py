"""`train.remat: auto`: the least recompute whose compiled step fits the device.

The policies a block can run under (`distill.models.model.REMAT_POLICIES`), ordered by what
the backward pass recomputes:

- none: nothing; every activation the backward needs is kept.
- dots: the matmul outputs are kept; the attention core (its whole forward: the fused
  kernels' custom VJPs rerun it to rebuild their residuals) and the elementwise ops (norms,
  RoPE, the activation) are recomputed, about the attention's share of a layer's forward.
- block: only each block's input is kept; the whole block's forward is recomputed (the step
  does about 4/3 of the model's FLOPs).

`choose` tries them in that order and takes the first whose compiled per-device peak
(XLA's memory analysis of the whole step: `pipelines.plan.memory`) fits the device's
memory less `HEADROOM`. It compiles lazily: a later candidate is compiled only when the
earlier ones do not fit, so a config that fits without recompute costs one compile, the
one the memory check makes anyway. The choice is a function of the compiled peaks and the
device size alone: the run, `distill plan` and `distill bench` resolve it the same way,
once, before any device work, and the run's `config.yaml` records the resolved policy.

On CPU devices there is no device memory to fit (XLA:CPU allocates from the host's memory,
shared by every simulated device and by other processes; a share of it would make the
choice depend on the machine and on the number of simulated devices), so `auto` is the
least recompute, `none`, and nothing is compiled to choose it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from distill.config import ModelConfig
from distill.models import counts

# Least recompute first.
CANDIDATES = ("none", "dots", "block")

# The share of a device's memory a step's compiled peak may not use. The device's memory
# is what JAX's client may allocate (`bytes_limit`: 75% of a GPU by default,
# XLA_PYTHON_CLIENT_MEM_FRACTION), and the memory analysis covers the step's own program
# only: the next step's batch and teacher output staged on the device while it runs
# (`pipeline.prefetch`), the metrics kept for the loop, the allocator's fragmentation and
# the GPU libraries' workspaces (cuBLAS, cuDNN, autotuning) come on top. At a 1B student's
# 4 x 4,096-token rows the staged inputs are under 0.1 GiB with a top-64 teacher; a tenth
# of a 60-130 GiB budget leaves several GiB for the rest. Dense teacher outputs (8 GiB of
# buffers at those rows) are refused on their own by `distill.handoff.check_dense_output`
# past a quarter of the device.
HEADROOM = 0.10


@dataclasses.dataclass(frozen=True)
class Choice:
    """The policy `train.remat` resolved to, and why."""

    policy: str
    reason: str
    peaks: dict[str, int] = dataclasses.field(default_factory=dict)  # compiled, by policy
    budget: int | None = None  # bytes a peak may take (device memory less HEADROOM)

    def describe(self) -> str:
        """One line for `distill plan` and the run's log."""
        return f"train.remat: {self.policy} ({self.reason})"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def choose(setting: str, peak_of: Callable[[str], int], device_bytes: int | None) -> Choice:
    """The policy `setting` (`train.remat`) stands for. A policy other than auto stands for
    itself. auto: on a device of `device_bytes` (None: CPU, no limit) the first of
    CANDIDATES whose peak, `peak_of(policy)` (bytes per device, compiled on demand), is at
    most (1 - HEADROOM) x device_bytes; when none is, `block`, the least memory, which the
    memory check then refuses in one line."""
    if setting != "auto":
        return Choice(setting, "as configured")
    if device_bytes is None:
        return Choice("none", "auto on CPU devices, which report no memory limit: no recompute")
    budget = device_bytes - round(device_bytes * HEADROOM)
    peaks: dict[str, int] = {}
    for policy in CANDIDATES:
        peaks[policy] = int(peak_of(policy))
        if peaks[policy] <= budget:
            break
    policy = next((p for p, b in peaks.items() if b <= budget), CANDIDATES[-1])
    tried = ", ".join(f"{p} {_gib(b)}" for p, b in peaks.items())
    verdict = "the least recompute that fits" if peaks[policy] <= budget else "none fits"
    reason = (
        f"auto: compiled peak per device {tried} vs {_gib(budget)} = {_gib(device_bytes)} "
        f"less {HEADROOM:.0%} headroom; {verdict}"
    )
    return Choice(policy, reason, peaks, budget)


def concrete(setting: str, platform: str) -> str:
    """`setting` as a policy a step can be built with: `auto` on CPU is `none` (`choose`);
    on an accelerator it must have been resolved from the compiled peaks first
    (`pipelines.plan.memory.resolve_remat`), never guessed here."""
    if setting != "auto":
        return setting
    if platform == "cpu":
        return choose(setting, lambda p: 0, None).policy
    raise ValueError(
        "train.remat: auto must be resolved from the compiled step's memory before the step "
        "is built (pipelines.plan.memory.resolve_remat)"
    )


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, policy: str) -> float:
    """FLOPs per token the backward pass of a `policy` step spends recomputing the forward,
    counted as `distill.models.counts.flops_per_token` counts the model's (matmuls, and
    attention's QK^T and PV over the whole causal square): none 0; dots each layer's
    attention core; block each layer's forward but its last matmul (the feed-forward's down
    projection, whose output the backward does not need, so XLA drops it). The LM head is
    not recomputed (`distill.models.vocab_loss` forms its gradient in the forward pass).
    Checked against XLA's cost analysis of loop-free steps in tests/test_remat.py."""
    if policy == "none":
        return 0.0
    attention = counts.attention_flops_per_token(cfg, seq_len)
    if policy == "dots":
        return attention
    layers = counts.flops_per_token(cfg, seq_len) - 2.0 * cfg.vocab_size * cfg.d_model
    moe = sum(cfg.moe_layers())
    dense_down = 2.0 * cfg.d_ff * cfg.d_model * (cfg.n_layers - moe)
    moe_down = 2.0 * cfg.experts_per_token * cfg.f_expert * cfg.d_model * moe
    return layers - dense_down - moe_down


def train_flops_per_token(cfg: ModelConfig, seq_len: int, policy: str) -> float:
    """Hardware FLOPs per token of a training step under `policy`: the model's (3 x the
    forward) plus the recompute."""
    return 3.0 * counts.flops_per_token(cfg, seq_len) + recompute_flops_per_token(
        cfg, seq_len, policy
    )
