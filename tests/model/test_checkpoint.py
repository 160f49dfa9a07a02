"""HF-style checkpoints: bitwise save/load round trips, tensor names and dtypes, fp8
block-scaled wkv, malformed checkpoints and configs, pipeline-stage loading, and the cache of the
bundled seeded model.

The fp8 oracle decodes e4m3 and e8m0 bytes in pure Python (float64, ``math.ldexp``); nothing in
it calls engramrt.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engramrt.bundled import DEFAULT_MODEL_DIR, GQA_MODEL_DIR, resolve_model_dir
from engramrt.bundled.train import SEED, corpus
from engramrt.config import ConfigError, engram_config, load_json
from engramrt.engram import load_hasher
from engramrt.engram.hashing import EngramHasher
from engramrt.engram.layout import EngramLayout
from engramrt.model.checkpoint import INDEX, CheckpointError, load_model
from engramrt.model.context import ForwardContext
from engramrt.model.decoder import EngramMHCModel
from engramrt.models import model_config
from engramrt.models.deepseek_v41 import quant
from engramrt.models.deepseek_v41.quant import StoredLinear
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner, new_kv_cache
from tests.support.fp8_oracle import e4m3_value
from tests.support.model_factory import make_model, make_raw_config, save_model

# Includes the pad id 2, repeats (shared n-grams), the last vocab id and the image id 5.
TOKENS = [0, 17, 300, 2, 2, 1023, 44, 17, 300, 2, 9, 5, 61, 17, 300, 8]
E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
BLOCK = 32

# ----------------------------------------------------------------------------- helpers

_TOKEN_MAPS: dict[str, torch.Tensor] = {}


def _hasher(model_dir: Path) -> EngramHasher:
    """``load_hasher(model_dir)``; the token map of a tokenizer seen before is reused, because
    building it takes seconds and every test model ships the bundled tokenizer."""
    key = hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest()
    if key not in _TOKEN_MAPS:
        hasher, _ = load_hasher(model_dir)
        _TOKEN_MAPS[key] = hasher.token_map
        return hasher
    layout = EngramLayout.from_config(engram_config(load_json(model_dir)))
    return EngramHasher(layout, _TOKEN_MAPS[key], 1)


def _logits(model: EngramMHCModel, model_dir: Path, tokens: list[int] = TOKENS) -> torch.Tensor:
    session = StageRunner(model, _hasher(model_dir), new_kv_cache(model, 1))
    return session.compute(StepBatch(tokens, [0], [len(tokens)], [0]))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _assert_same_state(got: EngramMHCModel, want: EngramMHCModel) -> None:
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for name, w in want_sd.items():
        g = got_sd[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        assert torch.equal(_bits(g), _bits(w)), name


def _edit(src: Path, dst: Path, fn: Callable[[dict[str, torch.Tensor]], object]) -> Path:
    """A copy of the single-file checkpoint ``src`` with its tensors edited by ``fn``."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    fn(state)
    save_file(state, dst / "model.safetensors")
    return dst


def _dequant_blocks_oracle(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[out, in]`` times 2**(e - 127) of its 32x32 block, in float64, rounded to bf16."""
    lut = [e4m3_value(b) for b in range(256)]
    w = weight.view(torch.uint8).tolist()
    s = scale.view(torch.uint8).tolist()
    out = [
        [math.ldexp(lut[b], s[r // BLOCK][c // BLOCK] - 127) for c, b in enumerate(row)]
        for r, row in enumerate(w)
    ]
    return torch.tensor(out, dtype=torch.float64).to(torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[EngramMHCModel, dict, Path]:
    """The default small config (4 layers, Engram at 1 and 2), bf16 with fp8 tables, saved."""
    model, raw = make_model(seed=2, dtype=torch.bfloat16, fp8_tables=True)
    return model, raw, save_model(model, raw, tmp_path_factory.mktemp("fp8") / "ckpt")


# ----------------------------------------------------------------------------- round trips

MOE = {
    "ffn_type": "moe",
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
}


@pytest.mark.parametrize(
    "kw",
    [
        {"dtype": torch.float32, "torch_dtype": "float32"},
        {"dtype": torch.bfloat16, "fp8_tables": True},
        {"dtype": torch.bfloat16, "fp8_tables": True, **MOE},
    ],
    ids=["fp32-plain-tables", "bf16-fp8-tables", "moe"],
)
def test_round_trip_is_bitwise(tmp_path: Path, kw: dict) -> None:
    """save -> load_model reproduces every tensor (dtype included) and the logits bit for bit."""
    model, raw = make_model(seed=1, **kw)
    out = save_model(model, raw, tmp_path / "ckpt")
    assert (out / "model.safetensors").is_file() and not (out / INDEX).exists()
    loaded = load_model(out)
    assert loaded.dtype == kw["dtype"]
    _assert_same_state(loaded, model)
    want = _logits(model, out)
    assert torch.isfinite(want).all()
    assert torch.equal(_logits(loaded, out), want)


def test_sharded_round_trip(tmp_path: Path, fp8_ckpt: tuple) -> None:
    """Small max_shard_bytes writes model-0000k-of-0000n files and an index covering every
    tensor; they load to the same tensors and logits."""
    model, raw, _ = fp8_ckpt
    out = save_model(model, raw, tmp_path / "sharded", max_shard_bytes=100_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 2
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((out / INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    for name, fname in index["weight_map"].items():
        assert name in load_file(out / fname), name
    loaded = load_model(out)
    _assert_same_state(loaded, model)
    assert torch.equal(_logits(loaded, out), _logits(model, out))


# ----------------------------------------------------------------------------- names and dtypes


def test_state_names_follow_spec(fp8_ckpt: tuple) -> None:
    """The saved names and shapes are DeepSeek-V4.1's (no hc_head_*), with nothing else besides the
    attention and FFN projections."""
    model, raw, out = fp8_ckpt
    text = raw["text_config"]
    layers, engram_ids = text["num_hidden_layers"], text["engram_layer_ids"]
    d, hc, hd = text["hidden_size"], text["hc_mult"], text["engram_head_dim"]
    cols = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"]
    mix = (2 + hc) * hc
    want = {"embed.weight": [1024, d], "norm.weight": [d], "head.weight": [1024, d]}
    for i in range(layers):
        for sub in ("attn", "ffn"):
            want[f"layers.{i}.hc_{sub}_fn"] = [mix, hc * d]
            want[f"layers.{i}.hc_{sub}_base"] = [mix]
            want[f"layers.{i}.hc_{sub}_scale"] = [3]
            want[f"layers.{i}.{sub}_norm.weight"] = [d]
    for i, rows in zip(engram_ids, text["engram_num_embeddings"], strict=True):
        e = f"layers.{i}.engram"
        want[f"{e}.embed.weight"] = [rows, hd]
        want[f"{e}.embed.scale"] = [rows, hd // BLOCK]
        want[f"{e}.wkv.weight"] = [(hc + 1) * d, cols * hd]
        want[f"{e}.q_weight"] = [hc, d]
        want[f"{e}.k_weight"] = [hc, d]
    saved = load_file(out / "model.safetensors")
    for name, shape in want.items():
        assert name in saved, name
        assert list(saved[name].shape) == shape, name
    projections = {f"attn.w{p}.weight" for p in "qkvo"} | {f"ffn.w{p}.weight" for p in "123"}
    rest = {n for n in saved if n not in want}
    assert all(n.split(".", 2)[2] in projections for n in rest), sorted(rest)
    assert not any("hc_head" in n for n in saved)
    for name, t in saved.items():
        if ".hc_" in name:
            assert t.dtype == torch.float32, name
        elif name.endswith("engram.embed.weight"):
            assert t.dtype == E4M3, name
        elif name.endswith("engram.embed.scale"):
            assert t.dtype == E8M0, name
        else:
            assert t.dtype == torch.bfloat16, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loaded_dtypes(fp8_ckpt: tuple, dtype: torch.dtype) -> None:
    """hc params load as fp32 whatever the model dtype; fp8 tables keep e4m3 + e8m0 scales;
    everything else takes the model dtype."""
    _, _, out = fp8_ckpt
    model = load_model(out, dtype=dtype)
    assert model.dtype == dtype
    for name, t in model.state_dict().items():
        if ".hc_" in name:
            assert t.dtype == torch.float32, name
        elif name.endswith("engram.embed.weight"):
            assert t.dtype == E4M3, name
        elif name.endswith("engram.embed.scale"):
            assert t.dtype == E8M0, name
        else:
            assert t.dtype == dtype, name
    table = model.layers["1"].engram.embed
    assert table.weight.dtype == E4M3 and table.scale.dtype == E8M0


def test_bf16_stored_hc_params_load_as_fp32(tmp_path: Path, fp8_ckpt: tuple) -> None:
    """An hc parameter stored in bf16 is upcast to fp32 on load, values unchanged."""
    _, _, out = fp8_ckpt
    name = "layers.2.hc_ffn_fn"
    src = load_file(out / "model.safetensors")[name].to(torch.bfloat16)
    edited = _edit(out, tmp_path / "ckpt", lambda s: s.update({name: src}))
    got = load_model(edited).state_dict()[name]
    assert got.dtype == torch.float32
    assert torch.equal(got, src.float())


# ----------------------------------------------------------------------------- fp8 wkv


@pytest.mark.parametrize("scale_dtype", [E8M0, torch.uint8])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"hidden_size": 72, "engram_head_dim": 18}],
    ids=["whole-blocks", "ragged-blocks"],
)
def test_fp8_block_scaled_wkv(tmp_path: Path, overrides: dict, scale_dtype: torch.dtype) -> None:
    """An e4m3 wkv with e8m0 scales [ceil(out/32), ceil(in/32)] loads as its blockwise
    dequantization (ragged edge blocks included; raw uint8 scale bytes read as e8m0)."""
    model, raw = make_model(seed=3, dtype=torch.bfloat16, **overrides)
    src = save_model(model, raw, tmp_path / "src")
    layer = raw["text_config"]["engram_layer_ids"][0]
    out_f, in_f = model.layers[str(layer)].engram.wkv.weight.shape
    if overrides:
        assert out_f % BLOCK and in_f % BLOCK
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(out_f, in_f, generator=gen) * 40).clamp(-448, 448).to(E4M3)
    blocks = (-(-out_f // BLOCK), -(-in_f // BLOCK))
    exps = torch.randint(115, 140, blocks, generator=gen, dtype=torch.uint8)
    scale = exps if scale_dtype == torch.uint8 else exps.view(E8M0)
    name = f"layers.{layer}.engram.wkv"
    fp8 = {f"{name}.weight": weight, f"{name}.scale": scale}
    edited = _edit(src, tmp_path / "fp8", lambda s: s.update(fp8))
    loaded = load_model(edited)
    got = loaded.layers[str(layer)].engram.wkv.weight
    want = _dequant_blocks_oracle(weight, exps)
    assert got.dtype == torch.bfloat16
    assert torch.equal(_bits(got), _bits(want))
    assert torch.isfinite(_logits(loaded, edited)).all()


def test_held_tensors_are_the_state_dicts_without_its_copies(v41_small: Path) -> None:
    """``held_tensors`` (what byte counts read) names the state dict's tensors with its sizes,
    as held: a paired FP4 expert is its own tensor there, where the state dict unpairs a copy.
    On the torch path the MoE's warm-up pairs nothing (that path decodes the stored order)."""
    from engramrt.models.deepseek_v41.moe import V41MoE

    model = load_model(v41_small)
    moe = next(m for m in model.modules() if isinstance(m, V41MoE))
    moe.warm_up(torch.float32)  # a CPU: the torch path
    assert not any(m.paired for m in moe.experts.modules() if isinstance(m, StoredLinear))
    expert = moe.experts[0].w1
    expert.pair()
    held, state = dict(model.held_tensors()), model.state_dict()
    assert held.keys() == state.keys()
    assert all(held[n].nbytes == state[n].nbytes for n in state)
    name = next(n for n, t in held.items() if t is expert.weight)
    assert state[name].data_ptr() != expert.weight.data_ptr()
    assert torch.equal(state[name], quant.unpair_fp4(expert.weight))


def test_v41_holds_the_engram_wkv_as_stored(tmp_path: Path, v41_small: Path) -> None:
    """V4.1 keeps the Engram's FP8 ``wkv`` in the checkpoint's bytes (a ``StoredLinear``: on a
    GPU the stored-format kernel reads half a dequantised copy's bytes) and computes it as the
    reference does: rows through ``act_quant``, exact products summed in fp32 (an fp64 oracle,
    within fp32 sums); a scale of the wrong shape is an error naming it. (A GQA model
    dequantises the same format: ``test_fp8_block_scaled_wkv``.)"""
    model = load_model(v41_small)
    stored = load_file(v41_small / "model.safetensors")
    layer = model.engram_layer_ids[0]
    name = f"layers.{layer}.engram.wkv"
    wkv = model.layers[str(layer)].engram.wkv
    assert isinstance(wkv, StoredLinear) and not wkv.fp4
    assert torch.equal(wkv.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8))
    assert torch.equal(wkv.scale.view(torch.uint8), stored[f"{name}.scale"].view(torch.uint8))
    assert model.state_dict()[f"{name}.weight"].dtype == torch.float8_e4m3fn
    rows = torch.randn(5, wkv.weight.shape[1], generator=torch.Generator().manual_seed(1))
    rows = rows.bfloat16()
    got = wkv(rows).double()
    a = quant.act_roundtrip(rows).double()
    w = quant.dequant_fp8_weight(wkv.weight, wkv.scale, torch.float64)
    exact = a @ w.T
    bound = (a.abs() @ w.abs().T) * 2**-20 + exact.abs() * 2**-8  # fp32 sums, a bf16 output
    assert bool(((got - exact).abs() <= bound).all())
    edited = tmp_path / "bad-scale"
    shutil.copytree(v41_small, edited)
    state = load_file(edited / "model.safetensors")
    state[f"{name}.scale"] = state[f"{name}.scale"][:-1].contiguous()
    save_file(state, edited / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{name}\.scale"):
        load_model(edited)


# ----------------------------------------------------------------------------- malformed


def _put(name: str, value: torch.Tensor) -> Callable[[dict], None]:
    return lambda s: s.update({name: value})


def _drop(*names: str) -> Callable[[dict], None]:
    return lambda s: [s.pop(n) for n in names]


def _retype(name: str, dtype: torch.dtype) -> Callable[[dict], None]:
    def fn(s: dict) -> None:
        s[name] = s[name].float().clamp(-8, 8).to(dtype)

    return fn


def _both(*fns: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda s: [f(s) for f in fns]


T1 = "layers.1.engram"  # 4618 rows x 32 in the default small config
MALFORMED = {
    "missing": (_drop("layers.0.attn.wq.weight"), ["layers.0.attn.wq.weight", "missing"]),
    "missing-table": (_drop(f"{T1}.embed.weight"), [f"{T1}.embed.weight", "missing"]),
    "unexpected": (
        _put("layers.0.attn.bias", torch.zeros(3)),
        ["layers.0.attn.bias", "unexpected"],
    ),
    "unexpected-wkv-scale-off-engram-layer": (
        _put("layers.0.engram.wkv.scale", torch.zeros(10, 24, dtype=torch.uint8)),
        ["layers.0.engram.wkv.scale"],
    ),
    "misshaped": (
        _put("layers.3.ffn.w1.weight", torch.zeros(95, 64, dtype=torch.bfloat16)),
        ["layers.3.ffn.w1.weight", "[95, 64]", "[96, 64]"],
    ),
    "misshaped-hc": (
        _put("layers.0.hc_attn_scale", torch.ones(4)),
        ["layers.0.hc_attn_scale", "[4]", "[3]"],
    ),
    "misshaped-table": (
        _both(
            _put(f"{T1}.embed.weight", torch.zeros(4617, 32).to(E4M3)),
            _put(f"{T1}.embed.scale", torch.zeros(4617, 1, dtype=torch.uint8).view(E8M0)),
        ),
        [f"{T1}.embed.weight", "[4617, 32]", "[4618, 32]"],
    ),
    "fp8-table-without-scale": (
        _drop(f"{T1}.embed.scale"),
        [f"{T1}.embed.weight", f"{T1}.embed.scale"],
    ),
    "table-scale-wrong-shape": (
        _put(f"{T1}.embed.scale", torch.zeros(4618, 2, dtype=torch.uint8).view(E8M0)),
        [f"{T1}.embed", "scale", "[4618, 2]", "[4618, 1]"],
    ),
    "plain-table-with-scale": (_retype(f"{T1}.embed.weight", torch.bfloat16), [f"{T1}.embed"]),
    "e5m2-table-without-scale": (
        _both(_retype(f"{T1}.embed.weight", torch.float8_e5m2), _drop(f"{T1}.embed.scale")),
        [f"{T1}.embed.weight", "float8_e5m2"],
    ),
    "stray-wkv-scale-on-bf16-wkv": (
        _put(f"{T1}.wkv.scale", torch.full((10, 24), 128, dtype=torch.uint8).view(E8M0)),
        [f"{T1}.wkv.scale", "not float8_e4m3fn"],
    ),
    "integer-weight": (
        _retype("layers.0.ffn_norm.weight", torch.int32),
        ["layers.0.ffn_norm.weight", "int32"],
    ),
    "integer-table": (
        _both(_retype(f"{T1}.embed.weight", torch.int8), _drop(f"{T1}.embed.scale")),
        [f"{T1}.embed.weight", "int8"],
    ),
    "fp8-e4m3-projection": (
        _retype("layers.0.attn.wq.weight", E4M3),
        ["layers.0.attn.wq.weight", "float8_e4m3fn"],
    ),
    "fp8-e5m2-projection": (
        _retype("layers.0.attn.wq.weight", torch.float8_e5m2),
        ["layers.0.attn.wq.weight", "float8_e5m2"],
    ),
    "fp8-head": (_retype("head.weight", E4M3), ["head.weight", "float8_e4m3fn"]),
    "e8m0-norm": (_retype("norm.weight", E8M0), ["norm.weight", "float8_e8m0fnu"]),
    "fp8-wkv-without-scale": (_retype(f"{T1}.wkv.weight", E4M3), [f"{T1}.wkv.weight"]),
    "wkv-scale-wrong-shape": (
        _both(
            _retype(f"{T1}.wkv.weight", E4M3),
            _put(f"{T1}.wkv.scale", torch.full((10, 23), 127, dtype=torch.uint8).view(E8M0)),
        ),
        [f"{T1}.wkv.scale", "[10, 23]", "[10, 24]"],
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint(tmp_path: Path, fp8_ckpt: tuple, case: str) -> None:
    """Each broken checkpoint raises CheckpointError (a ValueError) naming the tensor and, for
    shape errors, both shapes."""
    fn, words = MALFORMED[case]
    edited = _edit(fp8_ckpt[2], tmp_path / "ckpt", fn)
    with pytest.raises(CheckpointError) as info:
        load_model(edited)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def _poke(name: str, value: float, dtype: torch.dtype | None = None):
    def fn(state: dict[str, torch.Tensor]) -> None:
        t = state[name].to(dtype or state[name].dtype)
        t.view(-1)[1] = value
        state[name] = t

    return fn


@pytest.mark.parametrize(
    ("name", "value", "stored", "dtype"),
    [
        ("layers.2.ffn_norm.weight", math.nan, None, None),
        ("layers.0.hc_attn_scale", -math.inf, None, None),
        ("norm.weight", 1e5, torch.float32, "float16"),  # finite as stored, inf as held
    ],
    ids=["nan-norm", "inf-mhc-scale", "past-float16"],
)
def test_a_vector_that_is_not_finite_is_named_at_load(
    tmp_path: Path, fp8_ckpt: tuple, name: str, value: float, stored, dtype
) -> None:
    """Vectors are checked as the model holds them; a matrix is left to the sampler's check."""
    edited = _edit(fp8_ckpt[2], tmp_path / "ckpt", _poke(name, value, stored))
    with pytest.raises(CheckpointError, match=rf"tensor {name} holds 1 non-finite value.*index 1"):
        load_model(edited, dtype)
    matrix = _edit(fp8_ckpt[2], tmp_path / "matrix", _poke("layers.0.ffn.w1.weight", math.nan))
    assert load_model(matrix).layers["0"].ffn.w13.weight.isnan().any()


def test_index_pointing_at_missing_shard(tmp_path: Path, fp8_ckpt: tuple) -> None:
    """An index that lists a shard file which is not there is a CheckpointError naming it."""
    model, raw, _ = fp8_ckpt
    out = save_model(model, raw, tmp_path / "sharded", max_shard_bytes=100_000)
    gone = sorted(out.glob("model-*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(CheckpointError, match=gone.name):
        load_model(out)


@pytest.mark.parametrize("damage", ["truncate-header", "truncate-data", "garbage"])
def test_corrupt_safetensors_file_is_named(tmp_path: Path, fp8_ckpt: tuple, damage: str) -> None:
    """A truncated or corrupt shard is a CheckpointError naming the file (not a raw
    SafetensorError), whether the header or only the tensor data is damaged; the CLI exits 2."""
    from engramrt.cli import main

    model, raw, _ = fp8_ckpt
    out = save_model(model, raw, tmp_path / "ckpt")
    (f,) = out.glob("*.safetensors")
    data = f.read_bytes()
    cut = {"truncate-header": 20, "truncate-data": len(data) - 100, "garbage": 0}[damage]
    f.write_bytes(data[:cut] + (b"not a safetensors file" if damage == "garbage" else b""))
    with pytest.raises(CheckpointError, match=f.name):
        load_model(out)
    assert main(["generate", "--model", str(out), "--prompt", "hi", "--device", "cpu"]) == 2


@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_invalid_json_is_named(tmp_path: Path, fp8_ckpt: tuple, name: str) -> None:
    """An invalid config.json or index is an error naming the file, a ValueError (exit 2)."""
    model, raw, _ = fp8_ckpt
    out = save_model(model, raw, tmp_path / "sharded", max_shard_bytes=100_000)
    (out / name).write_text('{"hidden_size": 1,')
    with pytest.raises(ValueError, match=name):
        load_model(out)


def test_index_missing_an_entry(tmp_path: Path, fp8_ckpt: tuple) -> None:
    """A tensor that the index's weight_map leaves out is a CheckpointError naming it, not a
    bare KeyError."""
    model, raw, _ = fp8_ckpt
    out = save_model(model, raw, tmp_path / "sharded", max_shard_bytes=100_000)
    index = json.loads((out / INDEX).read_text())
    del index["weight_map"]["layers.0.attn.wq.weight"]
    (out / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="layers.0.attn.wq.weight"):
        load_model(out)


def test_directory_without_safetensors(tmp_path: Path, fp8_ckpt: tuple) -> None:
    """A config with no weight files next to it is a CheckpointError, not an empty model."""
    shutil.copyfile(fp8_ckpt[2] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tmp_path)


# ----------------------------------------------------------------------------- configs


def _without(*fields: str, **overrides) -> dict:
    raw = make_raw_config(**overrides)
    for f in fields:
        raw["text_config"].pop(f)
    return raw


COMPRESS = [4, 128, 4, 128]
BAD_CONFIGS = {
    "attention-missing": (_without("attention_type"), ["attention_type"]),
    "attention-csa": (
        _without(attention_type="csa", compress_ratios=COMPRESS),
        ["attention_type", "'csa'", "compress_ratios"],
    ),
    "v41-fields-missing": (  # compress_ratios and no attention_type: V4.1, whose fields it lacks
        _without("attention_type", compress_ratios=COMPRESS),
        ["qk_rope_head_dim", "missing"],
    ),
    "ffn-invalid": (_without(ffn_type="swiglu"), ["ffn_type", "'swiglu'"]),
    "ffn-missing": (_without("ffn_type"), ["ffn_type"]),
    "engram-layer-out-of-range": (
        _without(engram_layer_ids=[1, 4]),
        ["engram_layer_ids", "num_hidden_layers"],
    ),
    "engram-layer-past-short-model": (
        _without(num_hidden_layers=2),
        ["engram_layer_ids", "num_hidden_layers"],
    ),
    "heads-not-multiple-of-kv": (
        _without(num_attention_heads=6, num_key_value_heads=4),
        ["num_attention_heads", "num_key_value_heads"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_unrunnable_config(tmp_path: Path, case: str) -> None:
    """model_config and load_model reject the config with a ConfigError naming the field, before
    looking at any weights."""
    raw, words = BAD_CONFIGS[case]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for call in (lambda: model_config(raw), lambda: load_model(tmp_path)):
        with pytest.raises(ConfigError) as info:
            call()
        assert not isinstance(info.value, CheckpointError)
        for word in words:
            assert word in str(info.value), (word, str(info.value))
    if "compress_ratios" not in raw["text_config"]:
        assert "compressed sparse" not in str(info.value)


# ----------------------------------------------------------------------------- stages


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer model with an Engram (fp8 table) in both layers, saved."""
    model, raw = make_model(
        seed=5, dtype=torch.bfloat16, fp8_tables=True, num_hidden_layers=2, engram_layer_ids=[0, 1]
    )
    return save_model(model, raw, tmp_path_factory.mktemp("stages") / "ckpt")


def test_stage_loads_only_its_layers(two_layers: Path) -> None:
    """layer_ids=[0] / [1] load just that layer (embed with layer 0, norm + head with the last),
    skip the other stage's tensors, and the two stages chained give the full model's logits."""
    full = load_model(two_layers)
    first, last = load_model(two_layers, layer_ids=[0]), load_model(two_layers, layer_ids=[1])
    assert list(first.layers) == ["0"] and list(last.layers) == ["1"]
    assert first.embed is not None and first.norm is None and first.head is None
    assert last.embed is None and last.norm is not None and last.head is not None
    full_sd = full.state_dict()
    for stage, own in ((first, ("layers.0.", "embed.")), (last, ("layers.1.", "norm.", "head."))):
        sd = stage.state_dict()
        assert sorted(sd) == sorted(n for n in full_sd if n.startswith(own))
        for name, t in sd.items():
            assert t.dtype == full_sd[name].dtype, name
            assert torch.equal(_bits(t), _bits(full_sd[name])), name

    t = torch.tensor(TOKENS)
    hasher = _hasher(two_layers)
    ids = hasher.extend(t, torch.tensor([0]), torch.tensor([len(t)]), torch.tensor([0]))

    def ctx(m: EngramMHCModel) -> ForwardContext:
        kv = new_kv_cache(m, 1)
        return ForwardContext.for_runs(
            [0],
            [len(t)],
            [0],
            kv,
            kv.fixed_tables(),
            "cpu",
            hash_ids=ids,
            dead=hasher.is_dead(t),
        )

    with torch.inference_mode():
        want = full(t, ctx(full))
        x, pre = first.forward_layers(*first.embed_tokens(t), ctx(first))
        got = last.logits(*last.forward_layers(x, pre, ctx(last)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["layers.0.attn.bogus", "layers.7.attn.wq.weight", "bogus"])
def test_stage_still_rejects_unexpected(tmp_path: Path, two_layers: Path, name: str) -> None:
    """Skipping other stages' tensors does not let an unknown tensor through."""
    edited = _edit(two_layers, tmp_path / "ckpt", _put(name, torch.zeros(2)))
    with pytest.raises(CheckpointError, match=name):
        load_model(edited, layer_ids=[1])


# ----------------------------------------------------------------------------- bundled model


@pytest.mark.parametrize("model_dir", [DEFAULT_MODEL_DIR, GQA_MODEL_DIR], ids=["v41", "gqa"])
def test_bundled_models_are_trained_checkpoints_in_the_served_format(model_dir: Path) -> None:
    """The default model (V4.1, with its DSpark stage) and the GQA fixture are committed
    checkpoints in the served format (bf16 weights, hc parameters fp32, fp8 tables with the
    layout's row counts; V4.1's linears FP8 and its experts FP4 as released), with their
    held-out task files beside them."""
    assert resolve_model_dir(None) == DEFAULT_MODEL_DIR
    v41 = model_dir == DEFAULT_MODEL_DIR
    model = load_model(model_dir, dspark=v41)
    layout = EngramLayout.from_config(engram_config(load_json(model_dir)))
    assert model.dtype == torch.bfloat16
    for i in model.engram_layer_ids:
        table = model.layers[str(i)].engram.embed
        rows = layout.column_bounds(model.cfg.engram.layer_ids.index(i))[-1]
        assert table.weight.dtype == E4M3 and table.num_rows == rows
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".hc_" in n)
    if v41:
        stored = {m.weight.dtype for m in model.modules() if isinstance(m, StoredLinear)}
        assert stored == {E4M3, torch.int8} and len(model.mtp) == 1
        assert not any(m.master is not None for m in model.modules() if isinstance(m, StoredLinear))
    assert torch.isfinite(_logits(model, model_dir)).all()
    tasks = sorted(p.name for p in (model_dir / "tasks").iterdir())
    assert tasks == ["arithmetic.jsonl", "in_context.jsonl", "recall.jsonl"]
    held_out = corpus(SEED).tasks  # the shipped items are the ones the recipe held out
    for name in tasks:
        rows = [json.loads(line) for line in (model_dir / "tasks" / name).read_text().splitlines()]
        assert rows == held_out[name.removesuffix(".jsonl")]


def test_resolve_model_dir_passes_other_paths_through(tmp_path: Path) -> None:
    """A directory other than the bundled one is returned as given, nothing generated."""
    assert resolve_model_dir(tmp_path) == tmp_path
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    assert list(tmp_path.iterdir()) == []
