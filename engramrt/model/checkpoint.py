"""HF-style checkpoints: ``config.json`` + ``*.safetensors`` (optionally sharded with an index)
+ tokenizer files. Tensor names are DeepSeek-V4.1's; every mismatch names the tensor.

Names besides the Engram and hc ones: ``layers.{i}.attn.w{q,k,v,o}.weight``,
``layers.{i}.{attn,ffn}_norm.weight``, dense FFN ``layers.{i}.ffn.w{1,2,3}.weight`` (gate, down,
up), MoE ``layers.{i}.ffn.gate.weight``, ``.ffn.experts.{e}.w{1,2,3}.weight``,
``.ffn.shared_experts.w{1,2,3}.weight``.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engramrt.config import ModelConfig, load_json
from engramrt.engram.host_memory import HostMapping, mapping_bytes
from engramrt.engram.table import EngramTable
from engramrt.model.decoder import EngramMHCModel
from engramrt.model.fp8 import dequant_fp8_weight
from engramrt.models import model_config
from engramrt.tensor_parallel import SINGLE, TensorParallel

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHUNK_BYTES = 64 * 2**20  # how much of a table a host-placement load reads at a time

# tqdm's default lock holds a multiprocessing RLock: a named semaphore, registered with the
# server's resource tracker, which reports it leaked once an engine or stage process is killed.
# A loading bar is drawn by one process, so a thread lock is all it needs.
tqdm.set_lock(threading.RLock())


class CheckpointError(ValueError):
    """A checkpoint does not match its config; the message names the tensor."""


@contextlib.contextmanager
def _opened(f: Path) -> Iterator:
    """A safetensors file; a truncated or corrupt one is a ``CheckpointError`` naming it."""
    try:
        with safe_open(f, framework="pt") as st:
            yield st
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read checkpoint file {f}: {exc}") from None


def _files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index: {exc!r}") from None
        return {name: model_dir / f for name, f in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    out = {}
    for f in files:
        with _opened(f) as st:
            out.update(dict.fromkeys(st.keys(), f))
    return out


def _shapes(where: dict[str, Path]) -> dict[str, list[int]]:
    shapes = {}
    for f in sorted(set(where.values())):
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} listed in the index is missing")
        with _opened(f) as st:
            for name in st.keys():
                shapes[name] = list(st.get_slice(name).get_shape())
    return shapes


STORED_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "U8": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4}


def engram_table_bytes(model_dir: str | Path, layer_ids: list[int] | None = None) -> int:
    """The stored size of the Engram tables of ``layer_ids`` (default: all), from the shards'
    headers alone."""
    where = _files(Path(model_dir))
    total = 0
    for name, f in where.items():
        layer = name.split(".")[1] if name.startswith("layers.") else None
        if ".engram.embed." not in name or (layer_ids is not None and int(layer) not in layer_ids):
            continue
        with _opened(f) as st:
            part = st.get_slice(name)
            total += math.prod(part.get_shape()) * STORED_BYTES.get(part.get_dtype(), 4)
    return total


def _optional_scales(model: EngramMHCModel) -> set[str]:
    """Scales a checkpoint may give for weights the model holds dequantised: the Engram's, and
    its family's (``ModelFamily.optional_scales``)."""
    engram = {
        f"layers.{i}.engram.{part}.scale"
        for i in model.engram_layer_ids
        for part in ("embed", "wkv")
    }
    return engram | model.cfg.family.optional_scales(model)


def _skip_unrun(
    where: dict[str, Path], shapes: dict[str, list[int]], cfg: ModelConfig, dspark: bool
) -> None:
    """Drop the tensors the family does not run (``ModelFamily.unrun_reason``), one log line
    per kind."""
    skipped: dict[str, int] = {}
    for name in list(shapes):
        why = cfg.family.unrun_reason(name, dspark)
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            del shapes[name]
            where.pop(name, None)
    for why, n in skipped.items():
        print(f"engramrt: skipped {n} tensors of {why}", file=sys.stderr, flush=True)


def _hold_or_dequantise(model: EngramMHCModel, state: dict[str, torch.Tensor], scale: str):
    """An FP8 weight given with its scales for a dense layer (``_optional_scales``): the layer
    replaced by one that holds it as stored where the family reads it so
    (``ModelFamily.stored_linear``: half the bytes), else dequantised once."""
    name = scale.removesuffix(".scale")
    weight = state[name + ".weight"]
    held = None
    if weight.dtype == torch.float8_e4m3fn:
        try:
            held = model.cfg.family.stored_linear(weight, state[scale])
        except ValueError as exc:
            raise CheckpointError(f"tensor {scale}: {exc}") from exc
    if held is None:
        _dequantise_at_load(state, scale)
        return
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, held)
    del state[name + ".weight"], state[scale]


def _dequantise_at_load(state: dict[str, torch.Tensor], scale: str) -> None:
    """An FP8 weight the model holds dequantised (``_optional_scales``), with its 32 x 32 E8M0
    block scales: dequantised once, here."""
    name = scale.removesuffix(".scale") + ".weight"
    weight = state[name]
    if weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(
            f"tensor {scale} is given but {name} is {weight.dtype}, not float8_e4m3fn"
        )
    try:
        state[name] = dequant_fp8_weight(weight, state.pop(scale), torch.float32)
    except ValueError as exc:
        raise CheckpointError(f"tensor {scale}: {exc}") from None


def check_layer_count(model_dir: str | Path, cfg: ModelConfig) -> None:
    """The config's ``num_hidden_layers`` against the layers the checkpoint stores, from the
    tensor names alone: a config that asks for 100,000 layers of a 4-layer checkpoint is an
    error at once, not minutes of building a model that cannot load."""
    stored = {
        int(m.group(1))
        for name in _files(Path(model_dir))
        if (m := re.match(r"layers\.(\d+)\.", name))
    }
    # layers the config does not have are unexpected tensors, named by the full check
    if stored and not set(range(cfg.num_layers)) <= stored:
        raise CheckpointError(
            f"num_hidden_layers is {cfg.num_layers} but the checkpoint in {model_dir} stores "
            f"{len(stored)} layers (ids {min(stored)}-{max(stored)})"
        )


def default_dtype(stored: str, device: torch.device | str) -> str:
    """What an unset ``--dtype`` means to the commands (``engine.build``): the config's on a
    GPU; float32 on a CPU, where bfloat16 and float16 matmuls have no fast kernels on common
    CPUs (the bundled model's bfloat16 ran 6.6x slower than float32 on this project's CPU
    machine). ``load_model`` itself loads the config's dtype unless told otherwise."""
    return stored if torch.device(device).type != "cpu" else "float32"


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    layer_ids: list[int] | None = None,
    table_memory: str = "device",
    tp: TensorParallel = SINGLE,
    dspark: bool = False,
) -> EngramMHCModel:
    """Build the model (or the ``layer_ids`` of one pipeline stage) and load its weights;
    ``dspark``: V4.1's DSpark stages too (``mtp.*``, skipped otherwise).
    ``table_memory="host"``: the Engram tables are streamed from the shards into one host
    mapping (``engramrt.engram.host_memory``, registered with CUDA when ``device`` is a GPU)
    and stay there; the rest goes to ``device``. ``tp``: this rank reads only its slices of
    the sharded tensors (``EngramMHCModel.checkpoint_slices``), so its peak is its share."""
    if table_memory not in ("device", "host"):
        raise ValueError(f"table memory must be 'device' or 'host', got {table_memory!r}")
    model_dir = Path(model_dir)
    cfg = model_config(load_json(model_dir))
    check_layer_count(model_dir, cfg)
    if not isinstance(dtype, torch.dtype):
        name = dtype or cfg.torch_dtype
        if name not in DTYPES:
            raise CheckpointError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
        dtype = DTYPES[name]
    with torch.device("meta"):
        model = EngramMHCModel(cfg, dtype, layer_ids, tp, dspark)
        whole = EngramMHCModel(cfg, dtype, layer_ids, dspark=dspark) if tp.size > 1 else model
        full = EngramMHCModel(cfg, dtype, dspark=dspark) if layer_ids is not None else whole
    meta = whole.state_dict()
    expected = {k: list(v.shape) for k, v in meta.items()}
    slices = model.checkpoint_slices()
    known = set(full.state_dict()) | _optional_scales(full)  # other stages' tensors are skipped
    where = _files(model_dir)
    shapes = _shapes(where)
    _skip_unrun(where, shapes, cfg, dspark)
    unindexed = sorted(set(shapes) - set(where))
    if unindexed:
        raise CheckpointError(f"tensor {unindexed[0]} is stored but missing from {INDEX}")
    for name, shape in shapes.items():
        if name not in known:
            raise CheckpointError(f"unexpected tensor {name} (shape {shape}) in {model_dir}")
        if name in expected and shape != expected[name]:
            raise CheckpointError(
                f"tensor {name}: checkpoint shape {shape}, model expects {expected[name]}"
            )
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise CheckpointError(
            f"tensor {missing[0]} (shape {expected[missing[0]]}) is missing from {model_dir}"
            + (f", and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    optional = [n for n in _optional_scales(model) if n in shapes]
    names = [*expected, *optional]
    host = None
    if table_memory == "host":
        tables = [n for n in names if ".engram.embed." in n]
        register = torch.device(device).type == "cuda"
        state, host = _stream_to_host(where, tables, dtype, register, slices)
        names = [n for n in names if n not in state]
    else:
        state = {}
    state.update(_read(where, names, model_dir, slices))
    _install_engram(model, state, dtype, host, slices)
    for scale in [n for n in state if n.endswith(".scale") and n not in meta]:
        _hold_or_dequantise(model, state, scale)
    for name, t in state.items():
        want = meta[name].dtype  # as the model holds it: stored formats stay as stored
        if want.itemsize == 1 or not want.is_floating_point:
            if t.dtype != want:
                raise CheckpointError(f"tensor {name} has dtype {t.dtype}, expected {want}")
            continue
        if not t.is_floating_point() or t.element_size() == 1:
            raise CheckpointError(
                f"tensor {name} has dtype {t.dtype}, which needs a scale or is not a float"
            )
        state[name] = t.to(want)
    _check_vectors_finite(state)
    model.load_state_dict(state, strict=False, assign=True)
    state.clear()  # stacked projections were copied into new tensors: free the parts now
    leftover = [n for n, t in model.state_dict().items() if t.is_meta]
    if leftover:
        raise CheckpointError(f"tensor {leftover[0]} was not loaded")
    return model.to(device).eval().requires_grad_(False)  # inference only: no autograd state


def _check_vectors_finite(state: dict[str, torch.Tensor]) -> None:
    """Every vector (a tensor of at most one dimension: RMSNorm weights, the router's selection
    bias, attention sinks, mHC bases and scales) finite as the model holds it, so a float32
    value past bfloat16's range counts too. Every token passes through each of them, so one NaN
    there turns every request's logits into NaN; together they are about a megabyte (Flash:
    409 tensors), read in milliseconds. Matrices are not read here: a full check costs about
    80 s of a core at Flash's size (docs/models/checkpoints.md), and a NaN in a matrix reaches
    only the tokens that use it, whose requests the sampler ends with an error."""
    for name, t in state.items():
        if t.dim() > 1 or not t.is_floating_point() or t.element_size() == 1:
            continue
        bad = ~torch.isfinite(t.flatten())
        if bad.any():
            at = int(bad.nonzero()[0])
            raise CheckpointError(
                f"tensor {name} holds {int(bad.sum())} non-finite value(s) (the first, "
                f"{t.flatten()[at].item()}, at index {at}); every token passes through it"
            )


Slices = dict[str, tuple[int, int, int]]  # tensor -> (dim, lo, hi) a rank reads


def _read(
    where: dict[str, Path], names: list[str], model_dir: Path, slices: Slices
) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(where[name], []).append(name)
    state = {}
    with tqdm(
        total=len(names), desc=f"loading {model_dir.name}", unit="tensor", disable=None
    ) as bar:
        for f, group in by_file.items():
            with _opened(f) as st:
                for name in group:
                    if name in slices:
                        dim, lo, hi = slices[name]
                        state[name] = st.get_slice(name)[(slice(None),) * dim + (slice(lo, hi),)]
                    else:
                        state[name] = st.get_tensor(name)
                    bar.update()
    return state


def _stream_to_host(
    where: dict[str, Path],
    names: list[str],
    dtype: torch.dtype,
    register: bool,
    slices: Slices | None = None,
) -> tuple[dict[str, torch.Tensor], HostMapping]:
    """The tables ``names`` read from their shards into one host mapping: the bytes go from
    the file straight into the mapping (``readinto``, ``CHUNK_BYTES`` at a time, no file
    mapping whose pages would count as resident too), so the peak is the tables alone, not
    twice them. fp8 rows and e8m0 scales keep their format; plain rows take ``dtype``, as on
    the device (converted a chunk at a time when stored otherwise). A tensor-parallel rank
    reads its rows only (``slices``)."""
    meta = {}
    for name in names:
        with _opened(where[name]) as st:
            part = st.get_slice(name)
            stored = part[0:0].dtype
            target = stored if stored.itemsize == 1 else dtype  # fp8 weight, e8m0 scale
            shape = list(part.get_shape())
            _, first, end = (slices or {}).get(name, (0, 0, shape[0]))
            meta[name] = ([end - first, *shape[1:]], stored, target, first)
    sizes = [math.prod(shape) * target.itemsize for shape, _, target, _ in meta.values()]
    host = HostMapping(mapping_bytes(sizes), register)
    state = {}
    with tqdm(
        total=sum(sizes),
        desc="Engram tables to host memory",
        unit="B",
        unit_scale=True,
        disable=None,
    ) as bar:
        for name, (shape, stored, target, first) in meta.items():
            dst = host.tensor(shape, target)
            if stored == target:
                _read_into(where[name], name, dst, bar, first)
            else:  # a plain table stored in another dtype: converted by row chunks
                step = max(1, CHUNK_BYTES // max(1, math.prod(shape[1:]) * stored.itemsize))
                with _opened(where[name]) as st:
                    part = st.get_slice(name)
                    for lo in range(0, shape[0], step):
                        hi = min(shape[0], lo + step)
                        dst[lo:hi].copy_(part[first + lo : first + hi])
                        bar.update((hi - lo) * dst[0].numel() * target.itemsize)
            state[name] = dst
    return state, host


def _read_exactly(fh, n: int) -> bytes:
    """``n`` bytes (an unbuffered read may return fewer); a short file is a ValueError."""
    out = bytearray()
    while len(out) < n:
        got = fh.read(n - len(out))
        if not got:
            raise ValueError(f"the file ends {n - len(out)} bytes early")
        out += got
    return bytes(out)


def _read_into(f: Path, name: str, dst: torch.Tensor, bar: tqdm, first_row: int = 0) -> None:
    """Tensor ``name``'s rows ``[first_row, first_row + len(dst))`` from safetensors file ``f``
    into ``dst`` (same dtype): the format's 8-byte header length, its JSON header, then the
    data at the header's offsets (rows are contiguous)."""
    with open(f, "rb", buffering=0) as fh:
        try:
            (n,) = struct.unpack("<Q", _read_exactly(fh, 8))
            entry = json.loads(_read_exactly(fh, n))[name]
            lo, hi = entry["data_offsets"]
            rows = entry["shape"][0]
        except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
            raise CheckpointError(
                f"tensor {name}: unreadable safetensors header in {f}: {exc!r}"
            ) from None
        out = dst.view(-1).view(torch.uint8).numpy()
        row_bytes = out.nbytes // max(1, len(dst))
        if hi - lo != rows * row_bytes or first_row + len(dst) > rows:
            raise CheckpointError(
                f"tensor {name}: {hi - lo} bytes in {rows} rows stored in {f}, its shape and "
                f"dtype need {row_bytes} a row and rows up to {first_row + len(dst)}"
            )
        lo += first_row * row_bytes
        fh.seek(8 + n + lo)
        view = memoryview(out)
        for at in range(0, out.nbytes, CHUNK_BYTES):
            chunk = view[at : at + CHUNK_BYTES]
            while chunk.nbytes:
                got = fh.readinto(chunk)
                if not got:
                    raise CheckpointError(f"tensor {name}: {f} ends before its data does")
                chunk = chunk[got:]
            bar.update(min(CHUNK_BYTES, out.nbytes - at))


def _install_engram(
    model: EngramMHCModel,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    host: HostMapping | None = None,
    slices: Slices | None = None,
) -> None:
    """Tables keep their stored format (fp8 + e8m0 or plain). ``host``: the mapping the tables
    were streamed into, where they stay; ``slices``: the rows a tensor-parallel rank holds."""
    for i in model.engram_layer_ids:
        engram = model.layers[str(i)].engram
        prefix = f"layers.{i}.engram"
        weight, scale = (
            state.pop(f"{prefix}.embed.weight"),
            state.pop(f"{prefix}.embed.scale", None),
        )
        if scale is None:
            if not weight.is_floating_point() or weight.element_size() == 1:
                raise CheckpointError(
                    f"tensor {prefix}.embed.weight has dtype {weight.dtype} but there is no "
                    f"{prefix}.embed.scale"
                )
            weight = weight.to(dtype)
        _, row_start, _ = (slices or {}).get(f"{prefix}.embed.weight", (0, 0, 0))
        try:
            engram.embed = EngramTable(weight, scale, row_start, host=host)
        except ValueError as exc:
            named = f"{prefix}.embed.scale" if scale is not None else f"{prefix}.embed.weight"
            raise CheckpointError(f"tensor {named}: {exc}") from exc


def _own(t: torch.Tensor) -> torch.Tensor:
    """A tensor safetensors can save: stacked projections come out as views of one weight."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def save_checkpoint(
    model: EngramMHCModel,
    out_dir: str | Path,
    config: dict,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 2**30,
) -> Path:
    """Write ``model`` in the format ``load_model`` reads; shards (with an index) above
    ``max_shard_bytes``."""
    state = {k: _own(v.detach().cpu()) for k, v in model.state_dict().items()}
    return save_state(state, out_dir, config, tokenizer_dir, max_shard_bytes)


def save_state(
    state: dict[str, torch.Tensor],
    out_dir: str | Path,
    config: dict,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 2**30,
) -> Path:
    """Write named tensors (CPU, contiguous) as a checkpoint: shards with an index above
    ``max_shard_bytes``, the config, the tokenizer files of ``tokenizer_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors")
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / fname)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copyfile(src, out / name)
    return out
