"""A tiny Llama for llama.cpp, written here: a random transformers `LlamaForCausalLM` saved
as a Hugging Face checkpoint (distill's local teacher reads it) and the same weights as a
GGUF file (llama-cpp-python's server reads it), with distill's byte tokenizer as the GGUF's
SentencePiece-style vocabulary; and `python -m llama_cpp.server` on a real socket.

The vocabulary is `distill.data.tokenizers.ByteTokenizer`'s: PAD 0, BOS 1, EOS 2, byte b at
b + 3 (Llama 2's layout). llama.cpp's SentencePiece tokenizer turns text into those ids when
each printable ASCII character is a token of its own (the space as "▁", SentencePiece's
escape) and every other byte a byte-fallback token ("<0x0A>"); no merges. Every id gets a
text of its own when llama.cpp detokenizes it (its completions key log-probs by text): the
specials are user-defined tokens ("<s>" detokenizes as itself, and parses back to id 1),
and the bytes 0x80-0xFF, which alone are no UTF-8, are normal tokens named "<0xNN>" (the
byte fallback finds them by that name). The GGUF adds no BOS of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

VOCAB = 259  # ByteTokenizer.vocab_size
SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def write_llama(out: Path, seed: int = 0, scale: float = 0.25) -> Path:
    """A random tiny LlamaForCausalLM at `out` (config.json, model.safetensors); weights
    drawn with std `scale` so its distributions are far from flat (top-k without near-ties)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=scale, **SHAPE,
    )  # fmt: skip
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(out, safe_serialization=True)
    return out


def _tokens() -> tuple[list[str], list[int]]:
    import gguf

    t = gguf.TokenType
    texts = ["<pad>", "<s>", "</s>"]
    types = [t.USER_DEFINED] * 3
    for b in range(256):
        if b == 0x20:
            texts.append("\u2581")
            types.append(t.NORMAL)
        elif 0x21 <= b <= 0x7E:
            texts.append(chr(b))
            types.append(t.NORMAL)
        elif b >= 0x80:
            texts.append(f"<0x{b:02X}>")
            types.append(t.NORMAL)
        else:
            texts.append(f"<0x{b:02X}>")
            types.append(t.BYTE)
    return texts, [int(x) for x in types]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' rotate-half RoPE layout of q or k rows -> llama.cpp's interleaved one
    (what convert_hf_to_gguf.py does for Llama)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(hf_dir: Path, out: Path) -> Path:
    """The checkpoint at `hf_dir` as a float32 GGUF at `out`, with the byte vocabulary."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    w = load_file(str(hf_dir / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("distill-tiny-llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    writer.add_rope_freq_base(cfg.get("rope_parameters", cfg).get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    texts, types = _tokens()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(texts)
    writer.add_token_scores([0.0] * len(texts))
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}  # fmt: skip
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for name, array in w.items():
        array = np.ascontiguousarray(array.astype(np.float32))
        if name.endswith("q_proj.weight"):
            array = _permute(array, heads)
        elif name.endswith("k_proj.weight"):
            array = _permute(array, kv)
        writer.add_tensor(names[name], array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(gguf_path: Path, log: Path, n_ctx: int = 512, *flags: str):
    """`python -m llama_cpp.server` serving `gguf_path` on a free loopback port (logits for
    every position, which its prompt log-probs need; a float32 KV cache, so its log-probs are
    transformers' to about 1e-6), with more `flags`; yields its URL, stops it after."""
    port = _free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path),
           "--host", "127.0.0.1", "--port", str(port), "--logits_all", "true",
           "--n_ctx", str(n_ctx), "--n_threads", "1", "--n_threads_batch", "1",
           "--verbose", "false", "--type_k", "0", "--type_v", "0", *flags]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text()[-2000:]
                    raise RuntimeError(f"llama_cpp.server did not start: {tail}") from None
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
