"""Released quantized checkpoints (teacher/quantized.py): block float8 (DeepSeek-V3, Kimi K2)
and MXFP4 (gpt-oss) tensors quantized here in exactly the released layout, read slice by
slice, equal bit for bit to transformers' own dequantization of the whole tensor; a tiny
Llama whose Linear weights are stored as block float8 loads through teacher/hf.py into the
tp=2 layout exactly as its dequantized bf16 checkpoint does; unsupported layouts fail in
one DistillError line; a slice's read allocates about the slice, not the tensor."""

import json
import shutil
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers.integrations.finegrained_fp8 import (  # noqa: E402
    Fp8Dequantize,
    _dequantize_fp8_weight,
)
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from distill.config import ModelConfig  # noqa: E402
from distill.errors import DistillError  # noqa: E402
from distill.mesh import student_mesh, teacher_mesh  # noqa: E402
from distill.models import hf  # noqa: E402
from teacher import hf as teacher_hf  # noqa: E402
from teacher import quantized, sharding  # noqa: E402
from teacher.hf import load_hf_teacher, read_hf_layers  # noqa: E402

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}  # DeepSeek-V3's config.json, as released
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}  # fmt: skip  (gpt-oss-20b's)
E4M3_MAX = 448.0


def quantize_fp8(w: np.ndarray, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv) of a float32 [..., out, in] `w`, as
    DeepSeek's released files hold them: one scale per block (partial at the edges) mapping
    the block's largest magnitude to e4m3's 448."""
    *lead, rows, cols = w.shape
    bm, bn = block
    scale_inv = np.ones((*lead, -(-rows // bm), -(-cols // bn)), np.float32)
    for i in range(scale_inv.shape[-2]):
        for j in range(scale_inv.shape[-1]):
            part = np.abs(w[..., i * bm : (i + 1) * bm, j * bn : (j + 1) * bn])
            amax = part.max(axis=(-2, -1))
            scale_inv[..., i, j] = np.where(amax > 0, amax / E4M3_MAX, 1.0)
    expanded = np.repeat(np.repeat(scale_inv, bm, -2), bn, -1)[..., :rows, :cols]
    q = torch.from_numpy(np.clip(w / expanded, -E4M3_MAX, E4M3_MAX)).to(torch.float8_e4m3fn)
    return q, torch.from_numpy(scale_inv)


def _random_blocks(rng, shape, block=128) -> np.ndarray:
    """Normal values with a different magnitude per block, so every scale matters."""
    w = rng.standard_normal(shape).astype(np.float32)
    *lead, rows, cols = shape
    mags = 2.0 ** rng.integers(-12, 4, (*lead, -(-rows // block), -(-cols // block)))
    return w * np.repeat(np.repeat(mags, block, -2), block, -1)[..., :rows, :cols]


def _bits(x) -> np.ndarray:
    """The bit patterns of a float array (NaN and inf compared exactly too)."""
    x = np.asarray(x)
    return x.view({2: np.int16, 4: np.int32}[x.dtype.itemsize])


def _torch_bits(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)).numpy()


def _write(path, tensors: dict, config: dict | None, files: int = 1) -> None:
    """`tensors` saved as safetensors (in `files` shards with an index), and a config.json
    holding `config` as its quantization_config."""
    path.mkdir(parents=True, exist_ok=True)
    raw = {"model_type": "llama"} | ({"quantization_config": config} if config else {})
    (path / "config.json").write_text(json.dumps(raw))
    if files == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    names, weight_map = sorted(tensors), {}
    for k in range(files):
        file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[k::files]}
        save_file(part, str(path / file))
        weight_map |= dict.fromkeys(part, file)
    (path / hf.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


SLICES = [
    (slice(None), slice(None)),
    (slice(0, 150), slice(None)),  # tp=2 over rows: the cut inside block row 1
    (slice(150, 300), slice(None)),
    (slice(None), slice(100, 200)),  # tp=2 over columns: a partial last block column
    (slice(127, 129), slice(127, 130)),  # across block corners
    (slice(256, 300), slice(128, 200)),  # the partial corner block alone
    (slice(5, 290, 3), slice(1, 200, 7)),  # strided
    (slice(10, 10), slice(None)),  # empty
]


def test_fp8_slices_equal_transformers_dequantized_whole(tmp_path):
    """[300, 200] (partial edge blocks) and a [2, 300, 200] expert stack: every slice read,
    in float32 and in bfloat16, equals transformers' `_dequantize_fp8_weight` of the whole
    tensor (cast to bfloat16 after), bit for bit."""
    rng = np.random.default_rng(0)
    q2, s2 = quantize_fp8(_random_blocks(rng, (300, 200)))
    q3, s3 = quantize_fp8(_random_blocks(rng, (2, 300, 200)))
    tensors = {"a.weight": q2, "a.weight_scale_inv": s2, "b.weight": q3}
    tensors["b.weight_scale_inv"] = s3
    tensors["norm.weight"] = torch.randn(200).to(torch.bfloat16)
    _write(tmp_path, tensors, FP8_CONFIG)
    ckpt = quantized.Checkpoint(tmp_path)
    want_shapes = {"a.weight": (300, 200), "b.weight": (2, 300, 200)}  # norm.weight: not
    assert ckpt.quantized == quantized.quantized_shapes(tmp_path) == want_shapes
    for name, lead in (("a.weight", ()), ("b.weight", (slice(1, 2),))):
        q, s = tensors[name], tensors[name + "_scale_inv"]
        ref = _dequantize_fp8_weight(q, s, [128, 128], torch.float32)
        assert ckpt.slice(name).get_shape() == list(q.shape)
        for index in SLICES:
            at = (*lead, *index)
            got = ckpt.slice(name, np.float32)[at]
            np.testing.assert_array_equal(_bits(got), _torch_bits(ref[at].contiguous()))
            got16 = ckpt.slice(name)[at]  # dtype None: bfloat16
            assert got16.dtype == ml_dtypes.bfloat16
            want16 = ref[at].contiguous().to(torch.bfloat16)
            np.testing.assert_array_equal(_bits(got16), _torch_bits(want16))
    norm = ckpt.slice("norm.weight")[(slice(3, 9),)]  # unquantized: as stored
    np.testing.assert_array_equal(_bits(norm), _torch_bits(tensors["norm.weight"][3:9]))


def test_fp8_whole_blocks_equal_transformers_loading_op(tmp_path):
    """On whole blocks, what transformers' loader itself runs (`Fp8Dequantize`, which
    derives the block from the scale grid, so it needs whole blocks) gives the same bits in
    bfloat16."""
    q, s = quantize_fp8(_random_blocks(np.random.default_rng(1), (256, 384)))
    _write(tmp_path, {"x.weight": q, "x.weight_scale_inv": s}, FP8_CONFIG)
    want = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.bfloat16)
    got = quantized.Checkpoint(tmp_path).slice("x.weight", ml_dtypes.bfloat16)[:, :]
    np.testing.assert_array_equal(_bits(got), _torch_bits(want))


def test_fp8_power_of_two_scales_stored_as_e8m0(tmp_path):
    """`scale_fmt: ue8m0` (DeepSeek-V3.1): the scales are powers of two, stored as float32 or
    as float8_e8m0fnu bytes; both read as transformers dequantizes the float32 ones."""
    q, s = quantize_fp8(_random_blocks(np.random.default_rng(8), (300, 200)))
    s = torch.exp2(torch.ceil(torch.log2(s)))  # as transformers rounds them for ue8m0
    want = _dequantize_fp8_weight(q, s, [128, 128], torch.float32)
    for scale in (s, s.to(torch.float8_e8m0fnu)):
        tensors = {"x.weight": q, "x.weight_scale_inv": scale}
        _write(tmp_path, tensors, FP8_CONFIG | {"scale_fmt": "ue8m0"})
        got = quantized.Checkpoint(tmp_path).slice("x.weight", np.float32)[10:290, 50:]
        np.testing.assert_array_equal(_bits(got), _torch_bits(want[10:290, 50:].contiguous()))


def pack_mxfp4(rng, experts, rows, cols) -> tuple[torch.Tensor, torch.Tensor]:
    """Random gpt-oss `X_blocks` uint8 [E, rows, cols/32, 16] (two e2m1 codes a byte, every
    code) and `X_scales` uint8 [E, rows, cols/32] (every finite e8m0 exponent, 0..254)."""
    blocks = rng.integers(0, 256, (experts, rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(0, 255, (experts, rows, cols // 32), dtype=np.uint8)
    scales[..., 0] = rng.integers(120, 134, scales[..., 0].shape)  # and some usual ones
    return torch.from_numpy(blocks), torch.from_numpy(scales)


def test_mxfp4_slices_equal_transformers_convert_moe_packed_tensors(tmp_path):
    """gpt-oss's fused experts (E=3, D=96, F=64: gate_up_proj [E, D, 2F] stored as
    [E, 2F, D/32, 16] blocks, down_proj [E, F, D] as [E, D, F/32, 16]): every slice of the
    logical [E, in, out] tensor, the de-interleaved gate (even columns) and up (odd)
    included, equals transformers' `convert_moe_packed_tensors` of the whole, in float32
    and bfloat16, bit for bit."""
    rng = np.random.default_rng(2)
    e, f, d = 3, 64, 96
    gu_b, gu_s = pack_mxfp4(rng, e, 2 * f, d)
    dn_b, dn_s = pack_mxfp4(rng, e, d, f)
    prefix = "model.layers.0.mlp.experts."
    tensors = {
        prefix + "gate_up_proj_blocks": gu_b,
        prefix + "gate_up_proj_scales": gu_s,
        prefix + "gate_up_proj_bias": torch.randn(e, 2 * f).to(torch.bfloat16),
        prefix + "down_proj_blocks": dn_b,
        prefix + "down_proj_scales": dn_s,
    }
    _write(tmp_path, tensors, MXFP4_CONFIG, files=2)
    ckpt = quantized.Checkpoint(tmp_path)
    assert quantized.quantized_shapes(tmp_path) == {
        prefix + "gate_up_proj": (e, d, 2 * f),
        prefix + "down_proj": (e, f, d),
    }
    for name, (b, s) in {"gate_up_proj": (gu_b, gu_s), "down_proj": (dn_b, dn_s)}.items():
        with np.errstate(over="ignore"):
            ref = convert_moe_packed_tensors(b, s, dtype=torch.float32)
            ref16 = convert_moe_packed_tensors(b, s, dtype=torch.bfloat16)
        sl = ckpt.slice(prefix + name, np.float32)
        assert sl.get_shape() == list(ref.shape)
        n_in, n_out = ref.shape[1:]
        for index in [
            (slice(None),) * 3,
            (slice(1, 2), slice(None), slice(0, n_out // 2)),  # one expert, tp=2 over out
            (slice(None), slice(n_in // 2, n_in), slice(None)),  # tp=2 over in
            (slice(0, 3, 2), slice(5, 70), slice(3, 40)),  # groups cut at both ends
            (slice(None), slice(None), slice(0, n_out, 2)),  # gate (gate_up_proj)
            (slice(None), slice(None), slice(1, n_out, 2)),  # up
        ]:
            np.testing.assert_array_equal(_bits(sl[index]), _torch_bits(ref[index].contiguous()))
            got16 = ckpt.slice(prefix + name)[index]
            np.testing.assert_array_equal(_bits(got16), _torch_bits(ref16[index].contiguous()))
    bias = tensors[prefix + "gate_up_proj_bias"]  # bf16, read as stored
    got = ckpt.slice(prefix + "gate_up_proj_bias")[(slice(None), slice(0, 2 * f, 2))]
    np.testing.assert_array_equal(_bits(got), _torch_bits(bias[:, ::2].contiguous()))


def test_mxfp4_fused_experts_load_into_the_ep_tp_layout(tmp_path):
    """gpt-oss's fused experts of 2 layers (E=4, D=64, F=32) loaded through teacher/hf.py's
    layer path into the teacher's [L, E, D, F] / [L, E, F, D] parameters on an ep=2 x tp=2
    mesh, each layer's whole [E, ...] tensor into slot (layer,): the gate (even columns of
    gate_up_proj) and up (odd) halves as `we_gate` and `we_up`, down_proj as `we_down`,
    equal to transformers' dequantized arrays so split; each device read only its slice."""
    rng = np.random.default_rng(3)
    n_layers, e, d, f = 2, 4, 64, 32
    prefix = "model.layers.{}.mlp.experts."
    tensors, want = {}, {"we_gate": [], "we_up": [], "we_down": []}
    for i in range(n_layers):
        for proj, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            b, sc = pack_mxfp4(rng, e, rows, cols)
            tensors[prefix.format(i) + proj + "_blocks"] = b
            tensors[prefix.format(i) + proj + "_scales"] = sc
            with np.errstate(over="ignore"):
                ref = convert_moe_packed_tensors(b, sc, dtype=torch.bfloat16)
            if proj == "gate_up_proj":
                want["we_gate"].append(ref[..., ::2])
                want["we_up"].append(ref[..., 1::2])
            else:
                want["we_down"].append(ref)
    _write(tmp_path, tensors, MXFP4_CONFIG)
    ckpt = quantized.Checkpoint(tmp_path)
    cfg = ModelConfig(
        vocab_size=64, d_model=d, n_layers=n_layers, n_heads=4, n_kv_heads=2, d_ff=48,
        n_experts=e, d_ff_expert=f,
    )  # fmt: skip
    mesh = teacher_mesh(jax.devices()[:4], 1, 2, ep=2)
    targets = sharding.shardings(cfg, mesh)["layers"]
    shapes = []

    def watched(sl):
        def read(index):
            x = sl[index]
            shapes.append(x.shape)
            return x

        return read

    for key in want:
        stacked = None
        for i in range(n_layers):
            if key == "we_down":
                sl = ckpt.slice(prefix.format(i) + "down_proj")
            else:
                fused = ckpt.slice(prefix.format(i) + "gate_up_proj")
                sl = quantized.Strided(fused, -1, int(key == "we_up"), 2)
            shape = tuple(sl.get_shape())
            stacked = teacher_hf._load_layer(
                cfg, key, targets[key], stacked, watched(sl), shape, (i,), False
            )
        assert stacked.sharding == targets[key] and stacked.dtype == ml_dtypes.bfloat16
        ref = torch.stack(want[key]).contiguous()
        np.testing.assert_array_equal(_bits(np.asarray(stacked)), _torch_bits(ref))
        local = targets[key].shard_shape(stacked.shape)[1:]  # a device's [E/ep, ...] of a layer
        assert set(shapes) == {local}
        shapes.clear()


LLAMA = dict(
    vocab_size=64,
    hidden_size=192,
    intermediate_size=320,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    tie_word_embeddings=False,
)  # fmt: skip  (192 and 320: partial 128-blocks; tp=2 cuts q rows at 96, inside a block)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """(block-float8 checkpoint, its dequantized bfloat16 twin, its float32 twin): a tiny
    random Llama whose attention and MLP Linear weights are stored as DeepSeek stores them,
    everything else bf16, in 3 shards."""
    root = tmp_path_factory.mktemp("fp8_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA)
    m = transformers.LlamaForCausalLM(config)
    rng = np.random.default_rng(4)
    fp8, bf16, f32 = {}, {}, {}
    for name, p in m.state_dict().items():
        if any(f".{x}." in name for x in LINEARS):
            q, s = quantize_fp8(_random_blocks(rng, tuple(p.shape)))
            fp8[name], fp8[name + "_scale_inv"] = q, s
            whole = _dequantize_fp8_weight(q, s, [128, 128], torch.float32)
            f32[name], bf16[name] = whole, whole.to(torch.bfloat16)
        else:
            fp8[name] = bf16[name] = p.detach().normal_(1.0, 0.1).to(torch.bfloat16)
            f32[name] = fp8[name].float()
    dirs = []
    for sub, tensors, q in (("fp8", fp8, FP8_CONFIG), ("bf16", bf16, None), ("f32", f32, None)):
        _write(root / sub, tensors, q, files=3)
        config.to_json_file(str(root / sub / "config.json"))
        if q:
            raw = json.loads((root / sub / "config.json").read_text())
            raw["quantization_config"] = q
            (root / sub / "config.json").write_text(json.dumps(raw))
        dirs.append(root / sub)
    return dirs


@pytest.mark.parametrize("dtype, dp, tp", [(jax.numpy.bfloat16, 2, 2), (np.float32, 1, 4)])
def test_fp8_llama_loads_as_its_dequantized_checkpoint(llama_dirs, dtype, dp, tp):
    """load_hf_teacher onto a dp x tp mesh (tp=4: the 2 KV heads each read by 2 shards): the
    float8 checkpoint gives the parameters (values, dtype, sharding) of its dequantized twin
    in the held dtype, bit for bit."""
    fp8_dir, bf16_dir, f32_dir = llama_dirs
    assert len(quantized.quantized_shapes(fp8_dir)) == 2 * 7  # the Linear weights of 2 layers
    assert quantized.quantized_shapes(bf16_dir) == {}
    cfg = hf.read_model_config(fp8_dir)
    mesh = teacher_mesh(jax.devices()[: dp * tp], dp, tp)
    got = load_hf_teacher(fp8_dir, cfg, mesh, dtype=dtype)
    want = load_hf_teacher(bf16_dir if dtype != np.float32 else f32_dir, cfg, mesh, dtype=dtype)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype == dtype and g.sharding == w.sharding
        np.testing.assert_array_equal(_bits(np.asarray(g)), _bits(np.asarray(w)))


def test_an_unsupported_quantization_fails_the_load_in_one_line(llama_dirs, tmp_path):
    """The float8 Llama with its config.json claiming another quant_method: load_hf_teacher
    refuses it naming config.json, before reading any tensor."""
    shutil.copytree(llama_dirs[0], tmp_path / "ckpt")
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(raw))
    cfg = hf.read_model_config(tmp_path / "ckpt")
    with pytest.raises(DistillError, match=r"config.json: quantization_config.quant_method 'awq'"):
        load_hf_teacher(tmp_path / "ckpt", cfg, teacher_mesh(jax.devices()[:2], 1, 2))


def test_fp8_llama_layers_read_as_its_dequantized_checkpoint(llama_dirs):
    """read_hf_layers (a student from the teacher's layers) on a dp=2 x fsdp=4 mesh: the
    float8 checkpoint's kept layer equals the float32 twin's."""
    from student import train

    fp8_dir, _, f32_dir = llama_dirs
    cfg = hf.read_model_config(fp8_dir)
    scfg = cfg.model_copy(update={"n_layers": 1})
    where = train.param_shardings(scfg, student_mesh(jax.devices(), 2, 4))
    got = read_hf_layers(fp8_dir, cfg, [1], where)
    want = read_hf_layers(f32_dir, cfg, [1], where)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize(
    "config, match",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        (FP8_CONFIG | {"weight_block_size": None}, "only block-scaled fp8"),
        (FP8_CONFIG | {"fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
        (FP8_CONFIG | {"expert_dtype": "fp4"}, "expert_dtype 'fp4' is not supported"),
        (FP8_CONFIG | {"weight_block_size": [64, 64]}, r"needs \(3, 3\)"),
    ],
)
def test_unsupported_layouts_fail_in_one_line(tmp_path, config, match):
    q, s = quantize_fp8(_random_blocks(np.random.default_rng(5), (150, 150)))
    _write(tmp_path, {"x.weight": q, "x.weight_scale_inv": s}, config)
    with pytest.raises(DistillError, match=match) as err:
        quantized.Checkpoint(tmp_path)
    assert "\n" not in str(err.value) and "config.json" in str(err.value)


def test_missing_scales_fail_naming_the_tensor(tmp_path):
    q, _ = quantize_fp8(_random_blocks(np.random.default_rng(6), (150, 150)))
    _write(tmp_path / "a", {"x.weight": q}, FP8_CONFIG)
    with pytest.raises(DistillError, match="x.weight is float8 without its x.weight_scale_inv"):
        quantized.quantized_shapes(tmp_path / "a")
    b, _ = pack_mxfp4(np.random.default_rng(6), 2, 4, 32)
    _write(tmp_path / "b", {"e.gate_up_proj_blocks": b}, MXFP4_CONFIG)
    with pytest.raises(DistillError, match="e.gate_up_proj_blocks without its e.gate_up_proj_"):
        quantized.quantized_shapes(tmp_path / "b")


@pytest.mark.parametrize("threads", [1, 4])
def test_a_slice_read_allocates_the_slice_not_the_tensor(tmp_path, monkeypatch, threads):
    """A tp=4 row slice of a [4096, 4096] float8 weight (16 MiB stored, 32 MiB as bf16):
    the stored bytes read are the slice's rows and their scales only, and the read
    allocates (tracemalloc) the bf16 output slice plus, per dequantizing thread, one 128-row
    block of it in float8 and float32, never the tensor."""
    rng = np.random.default_rng(7)
    q, s = quantize_fp8(rng.standard_normal((4096, 4096), dtype=np.float32))
    _write(tmp_path, {"x.weight": q, "x.weight_scale_inv": s}, FP8_CONFIG)
    del q, s
    sl = quantized.Checkpoint(tmp_path).slice("x.weight", ml_dtypes.bfloat16)
    want = sl[(slice(1024, 2048), slice(None))]
    monkeypatch.setattr(quantized, "THREADS", threads)
    read_bytes, real = [], quantized.Stored.read

    def counted(self, index):
        x = real(self, index)
        read_bytes.append(x.nbytes)
        return x

    monkeypatch.setattr(quantized.Stored, "read", counted)
    tracemalloc.start()
    try:
        x = sl[(slice(1024, 2048), slice(None))]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    whole_bf16, out = 4096 * 4096 * 2, x.nbytes  # 32 MiB, 8 MiB
    block_row = 128 * 4096 * (1 + 4)  # float8 and float32
    scales = 8 * 32 * 4  # the slice's 8 block rows of 32 scales
    print(
        f"read {sum(read_bytes) / 2**20:.2f} MiB stored, peak {peak / 2**20:.2f} MiB "
        f"allocated, for an {out / 2**20:.0f} MiB slice of a {whole_bf16 / 2**20:.0f} MiB tensor"
    )
    np.testing.assert_array_equal(_bits(x), _bits(want))  # the same on any threads
    assert sum(read_bytes) == 1024 * 4096 + scales  # the slice's float8 rows, its scales
    assert max(read_bytes) <= 128 * 4096  # one block row at a time
    # one block row per dequantizing thread, and numpy's index buffers
    assert out <= peak <= out + threads * block_row + 2**20


@pytest.mark.parametrize("threads", [1, 4])
def test_an_mxfp4_slice_read_allocates_one_expert_at_a_time(tmp_path, monkeypatch, threads):
    """An ep=2 x tp=2 slice (2 of 4 experts, half the columns) of a fused [4, 1024, 1024]
    gate_up_proj (2 MiB of blocks; 8 MiB as bf16): only the slice's rows of blocks and
    scales are read, and the read allocates the bf16 output plus, per dequantizing thread,
    one expert's slice in float32 (with a half-size lookup and its packed bytes)."""
    b, sc = pack_mxfp4(np.random.default_rng(9), 4, 1024, 1024)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    _write(tmp_path, {name + "_blocks": b, name + "_scales": sc}, MXFP4_CONFIG)
    sl = quantized.Checkpoint(tmp_path).slice(name, ml_dtypes.bfloat16)
    want = sl[(slice(2, 4), slice(None), slice(512, 1024))]
    monkeypatch.setattr(quantized, "THREADS", threads)
    read_bytes, real = [], quantized.Stored.read

    def counted(self, index):
        x = real(self, index)
        read_bytes.append(x.nbytes)
        return x

    monkeypatch.setattr(quantized.Stored, "read", counted)
    tracemalloc.start()
    try:
        x = sl[(slice(2, 4), slice(None), slice(512, 1024))]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    whole_bf16, out, expert_f32 = 4 * 1024 * 1024 * 2, x.nbytes, 1024 * 512 * 4
    print(
        f"read {sum(read_bytes) / 2**20:.2f} MiB stored, peak {peak / 2**20:.2f} MiB "
        f"allocated, for a {out / 2**20:.0f} MiB slice of an {whole_bf16 / 2**20:.0f} MiB tensor"
    )
    np.testing.assert_array_equal(_bits(x), _bits(want))  # the same on any threads
    assert sum(read_bytes) == 2 * 512 * 32 * (16 + 1)  # the slice's rows of blocks and scales
    # per thread an expert's float32, a lookup, its packed bytes
    assert out <= peak <= out + threads * 2 * expert_f32
