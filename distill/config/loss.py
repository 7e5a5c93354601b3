"""The `distill` section: the loss between teacher and student (divergence, temperature,
alpha and what lowers it, the comparison across tokenizers) and its on-policy share."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distill.config.model import Section


class OnPolicyConfig(Section):
    """On-policy distillation (GKD): the student learns on its own continuations, which
    the teacher scores token by token. prompt_len and max_new_tokens also set the
    continuations every evaluation samples (`sample_teacher_nll`)."""

    fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of batches trained on the student's own continuations (GKD's "
        "lambda): 0 is off-policy KD on the data, 1 fully on-policy.",
    )
    prompt_len: int | None = Field(
        None,
        ge=1,
        description="Prompt tokens: the first prompt_len tokens of each packed row (or, with "
        "data.prompt_field, each prompt's last ones); default min(32, train.seq_len / 4).",
    )
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens the student generates per prompt (it stops earlier at EOS, the "
        "end of its document); default min(64, train.seq_len + 1 - prompt_len).",
    )
    start_step: int = Field(
        0,
        ge=0,
        description="Steps up to this one are all off-policy (the student first learns on the "
        "data, as GKD starts from a trained student); fraction applies after it.",
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1: off).")

    def lengths(self, seq_len: int) -> tuple[int, int]:
        """(prompt_len, max_new_tokens) with their defaults for rows of `seq_len` tokens."""
        p = self.prompt_len or max(1, min(32, seq_len // 4))
        return p, self.max_new_tokens or max(1, min(64, seq_len + 1 - p))


class DistillLossConfig(Section):
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "forward_kl", description="Divergence between teacher and student."
    )
    temperature: float = Field(2.0, gt=0, description="Softmax temperature T (KD scaled by T^2).")
    alpha: float = Field(0.5, ge=0, le=1, description="loss = alpha * T^2 * KD + (1 - alpha) * CE.")
    alpha_gate: bool = Field(
        True,
        description="Distil only while the teacher predicts the held-out text better than the "
        "student: after each evaluation (at the start and every train.eval_every steps) "
        "alpha is the configured one while the teacher's held-out bits per byte are below the "
        "student's, else 0 (cross-entropy alone) until an evaluation finds the teacher better "
        "again (the teacher's training forward skipped meanwhile), and the on-policy steps "
        "(distill.on_policy) are data steps; kept in "
        "checkpoints, shown in the status and each record's alpha. false: alpha throughout.",
    )
    beta: float = Field(0.5, gt=0, lt=1, description="JSD mixture weight.")
    cross_tokenizer: Literal["mapped", "first_byte", "byte_path", "uld"] = Field(
        "first_byte",
        description="With a teacher.tokenizer other than data.tokenizer: mapped (teacher tokens "
        "spelling a student token's bytes map to it, the rest to a tail bucket), first_byte "
        "(both marginalised onto the next byte), byte_path (first_byte, then the next byte "
        "after each byte of the target token; a byte-level teacher only), each with "
        "distill.loss over the buckets; or uld (sorted-probability L1 distance, no shared "
        "tokens needed).",
    )
    cross_ce: Literal["full", "one_minus_alpha"] = Field(
        "full",
        description="Across tokenizers, the weight of the student's own cross-entropy: full "
        "(loss = alpha * T^2 * KD + CE: the divergence reaches only a coarse-graining of the "
        "student's distribution, its next byte or the tokens both vocabularies spell, so the "
        "cross-entropy keeps its whole weight) or one_minus_alpha (as with one vocabulary).",
    )
    cross_boundary: bool = Field(
        True,
        description="first_byte and byte_path: keep both next-byte distributions at a student "
        "position to the bytes that follow its input token somewhere in the training text "
        "(the teacher's next byte conditioned on the student's token boundary); false: over "
        "every byte both vocabularies reach.",
    )
    moe_aux_loss: float = Field(
        0.0,
        ge=0,
        description="A mixture-of-experts student: this times its auxiliary load-balancing "
        "loss (Switch/Mixtral, as transformers' load_balancing_loss_func, over the real "
        "tokens) is added to the loss; 0: off (the loss is still reported). A checkpoint's "
        "router_aux_loss_coef is not applied unless set here.",
    )
    on_policy: OnPolicyConfig = Field(default_factory=OnPolicyConfig)
