"""What a `ModelConfig`'s keys imply, read by the model and its loaders: head widths, the
dims RoPE rotates, every layer's kind (window, RoPE, mixer, feed-forward) and the
attention score scale. A mixin of `distill.config.model.ModelConfig`, kept apart from its
fields."""

from __future__ import annotations

import math

from distill.config.rope import yarn_mscale


class ModelViews:
    """The derived views of a `ModelConfig` (its fields are read as attributes)."""

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (`kv_lora_rank` set)."""
        return self.kv_lora_rank is not None

    @property
    def hd(self) -> int:
        """Each query and key head's width (latent attention: nope + rope dims)."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.d_model // self.n_heads

    @property
    def v_dim(self) -> int:
        """Each value head's width: `hd` but under latent attention."""
        return self.v_head_dim if self.mla else self.hd

    @property
    def rope_dim(self) -> int:
        """The dims of each query and key head that RoPE rotates (the first ones, or under
        latent attention the last qk_rope_head_dim)."""
        if self.mla:
            return self.qk_rope_head_dim
        return int(self.hd * self.partial_rotary_factor)

    def types(self) -> tuple[str, ...]:
        """Every layer's attention type, full or sliding."""
        if self.layer_types is not None:
            return self.layer_types
        return ("sliding" if self.sliding_window else "full",) * self.n_layers

    def ropes(self) -> tuple[bool, ...]:
        """Per layer, whether it applies RoPE (a NoPE layer does not)."""
        return self.rope_layers if self.rope_layers is not None else (True,) * self.n_layers

    def mixed_windows(self) -> bool:
        """Whether attention layers differ in window (full and sliding); linear layers have
        none."""
        return len(set(self.types()) - {"linear"}) > 1

    def mixed_layers(self) -> bool:
        """Whether layers differ in window or RoPE (then each layer's are scanned data)."""
        return self.mixed_windows() or len(set(self.ropes())) > 1

    def full_apart(self) -> bool:
        """Whether full-attention layers hold attention weights of their own shapes (Gemma
        4: another head width, other KV heads, values from the keys' projection): a part of
        their own (`distill.models.parts`), run beside the sliding layers'; with KV sharing
        too, each kind sharing its own in its branch."""
        own = self.global_head_dim is not None or self.global_kv_heads is not None
        return own or self.attn_k_eq_v or self.kv_shared_layers > 0

    def kv_shared(self) -> tuple[bool, ...]:
        """Per layer, whether it takes its keys and values from an earlier layer (the last
        `kv_shared_layers`)."""
        return tuple(i >= self.n_layers - self.kv_shared_layers for i in range(self.n_layers))

    def kv_stores(self) -> tuple[bool, ...]:
        """Per layer, whether later layers share its keys and values: the last layer of
        each type before the sharing ones (none without sharing)."""
        first, types = self.n_layers - self.kv_shared_layers, self.types()
        last = {t: i for i, t in enumerate(types[:first])}
        stores = set(last.values()) if self.kv_shared_layers else set()
        return tuple(i in stores for i in range(self.n_layers))

    def wide_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its MLP is twice as wide (`wide_mlp`: the sharing layers)."""
        return tuple(self.wide_mlp and s for s in self.kv_shared())

    def kind_hd(self, kind: str) -> int:
        """The head width of a layer of type `kind` (full layers' may be their own)."""
        return self.global_head_dim or self.hd if kind == "full" else self.hd

    def kind_kv_heads(self, kind: str) -> int:
        """The KV heads of a layer of type `kind` (full layers' may be their own)."""
        return self.global_kv_heads or self.n_kv_heads if kind == "full" else self.n_kv_heads

    def linear_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is a linear-attention layer."""
        return tuple(t == "linear" for t in self.types())

    def mixed_mixers(self) -> bool:
        """Whether linear and attention layers alternate (then a per-layer flag is scanned)."""
        return len(set(self.linear_layers())) > 1

    def attention_type(self) -> str:
        """The attention layers' type when they are all alike (full when every layer is
        linear)."""
        kinds = [t for t in self.types() if t != "linear"]
        return kinds[0] if kinds else "full"

    @property
    def f_expert(self) -> int:
        return self.d_ff_expert or self.d_ff

    @property
    def f_shared(self) -> int:
        """The shared expert's hidden width; 0: none (always 0 without routed experts)."""
        return self.d_ff_shared if self.n_experts else 0

    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its feed-forward is the routed mixture of experts."""
        dense = set(self.dense_layers)
        return tuple(bool(self.n_experts) and i not in dense for i in range(self.n_layers))

    def has_dense_ffn(self) -> bool:
        """Whether any layer runs the dense feed-forward (every layer of a dense model, and
        every one of Gemma 4's MoE block, `moe_beside_dense`)."""
        return not all(self.moe_layers()) or self.moe_beside_dense

    def mixed_ffn(self) -> bool:
        """Whether dense and MoE feed-forwards alternate (then a per-layer flag is scanned)."""
        return len(set(self.moe_layers())) > 1

    def scale(self) -> float:
        """The attention score scale: `query_scale`, else 1/sqrt(hd), under latent attention
        with YaRN's mscale_all_dim times its mscale squared (transformers' DeepSeek-V3
        `yarn_apply_mscale`)."""
        if self.query_scale is not None:
            return self.query_scale
        scale = 1 / math.sqrt(self.hd)
        rope = self.rope_scaling
        if self.mla and rope is not None and rope.type == "yarn" and rope.mscale_all_dim:
            scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        return scale
