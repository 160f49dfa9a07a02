"""DeepSeek-V4.1's low-precision formats and the rounding points of its forward, as its reference
computes them: every value that crosses one of them is rounded here, in one place.

Formats (as stored in the released checkpoint and used inside the forward):

- **E4M3** (``torch.float8_e4m3fn``): dense weights, and every activation before an FP8 or FP4
  linear; casts saturate at +-448 (the CUDA ``satfinite`` conversion), round to nearest even.
- **E8M0** (``F8_E8M0`` in safetensors, read as raw bytes): a power-of-two scale, byte ``b`` is
  ``2**(b - 127)``, 255 is NaN; block scales of FP8 weights (32 x 32) and FP4 experts (1 x 32).
- **E2M1** (FP4): 16 codes, bit 3 the sign, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; two codes a
  byte in the checkpoint's I8 expert weights, the even element in the low nibble.

Rounding points (each ``*_roundtrip`` returns the rounded value dequantised, in the input dtype;
the computation is fp32 throughout, as the reference's kernels do it):

- ``act_quant``: E4M3 per block of 32 with the power-of-two scale ``2**ceil(log2(amax / 448))``
  taken from the fp32 bits of ``amax * fp32(1/448)``, amax floored at 1e-4: before every
  quantised linear, and (round trip) the window KV over all 512 dims.
- ``fp4_roundtrip(x, E4M3_SCALE)``: E2M1 per 16 with an E4M3 scale ``e4m3(amax / 6)``, amax
  floored at ``6 * 2**-9``: the compressed KV.
- ``fp4_roundtrip(x, POW2_SCALE)``: E2M1 per 32 with the power-of-two scale of
  ``amax * fp32(1/6)``, amax floored at ``6 * 2**-126``: index keys and indexer queries.
"""

from __future__ import annotations

import torch
from torch import nn

from engramrt.kernels import use_triton
from engramrt.kernels.linear import linear
from engramrt.model.fp8 import decode_e8m0, dequant_fp8_weight

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# the reference's kernels multiply by the reciprocal, as an fp32 constant
_INV_E4M3_MAX = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
_INV_E2M1_MAX = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32)

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the value of each 4-bit code (bit 3: sign)
E2M1_VALUES = torch.tensor([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)])
# between magnitude codes i and i + 1; at an exact midpoint the even code wins (round to nearest
# even): the upper one for the midpoints after codes 1, 3 and 5
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_TIES_UP = torch.tensor([False, True, False, True, False, True, False])

E4M3_SCALE, POW2_SCALE = "e4m3", "pow2"  # the two FP4 scale kinds


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] as 4-bit E2M1 codes (uint8), rounded to nearest even; the sign of
    zero is kept."""
    mag = v.abs().unsqueeze(-1)
    mids = _E2M1_MIDPOINTS.to(v.device)
    code = (mag > mids).sum(-1) + ((mag == mids) & _E2M1_TIES_UP.to(v.device)).sum(-1)
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_VALUES.to(codes.device)[codes.long()]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The checkpoint's I8 expert weights ``[..., K / 2]`` as fp32 values ``[..., K]``: two codes
    a byte, the even element in the low nibble."""
    return decode_e2m1(unpack_codes(packed))


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[..., K]`` as the checkpoint's I8 bytes ``[..., K / 2]``."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The checkpoint's FP4 bytes ``[..., K / 2]`` as 4-bit codes ``[..., K]`` (uint8)."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def _whole_groups(k: int) -> int:
    """The elements of an FP4 row ``k`` long in whole 64-wide groups (the rest: 0 or 32)."""
    if k % 32:
        raise ValueError(f"FP4 rows come in whole 32-wide blocks, got {k} elements")
    return k // 64 * 64


def pair_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The checkpoint's FP4 bytes ``[..., K / 2]`` (even element low) in the layout the GPU
    kernel reads (``kernels.stored_linear``): each 64-element group's byte ``j`` holds its
    elements ``j`` (low nibble) and ``j + 32`` (high), i.e. element j of a block and of the
    next; an odd last block holds its ``j`` and ``j + 16``. A permutation of the nibbles
    within a row (``unpair_fp4`` inverts it): the same size, no dequantised copy."""
    codes = unpack_codes(packed)
    whole = _whole_groups(codes.shape[-1])
    groups = [codes[..., :whole].unflatten(-1, (-1, 64)), codes[..., whole:][..., None, :]]
    out = [g[..., : g.shape[-1] // 2] | (g[..., g.shape[-1] // 2 :] << 4) for g in groups]
    return torch.cat([o.flatten(-2) for o in out], -1).view(torch.int8)


# the largest E8M0 exponent of an FP4 block the GPU kernel decodes exactly (2**(s - 1) in bf16):
# a block's values up to 12; DeepSeek's experts' stay far below 1
FP4_KERNEL_MAX_SCALE = 128


def check_fp4_scales(scale: torch.Tensor, what: str = "an FP4 weight") -> None:
    """FP4 E8M0 scales as the GPU kernel decodes them exactly: one sync at load, so a stack
    of experts is checked at once (``what`` names it; a stack's error names the expert)."""
    top = int(scale.view(torch.uint8).max()) if scale.numel() else 0
    if top > FP4_KERNEL_MAX_SCALE:
        if scale.dim() == 3:
            expert = int(scale.view(torch.uint8).flatten(1).amax(1).argmax())
            what = f"{what}, expert {expert}"
        raise ValueError(
            f"{what}: an FP4 block scale of 2**{top - 127} is above the GPU kernel's largest, "
            f"2**{FP4_KERNEL_MAX_SCALE - 127} (block values above 12)"
        )


def unpair_fp4(paired: torch.Tensor) -> torch.Tensor:
    """``pair_fp4``'s bytes back in the checkpoint's order."""
    b = paired.view(torch.uint8)
    whole = _whole_groups(2 * b.shape[-1])
    groups = [b[..., : whole // 2].unflatten(-1, (-1, 32)), b[..., whole // 2 :][..., None, :]]
    codes = [torch.cat([g & 0x0F, g >> 4], -1).flatten(-2) for g in groups]
    return pack_e2m1(torch.cat(codes, -1))


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 to E4M3, round to nearest even, saturating at +-448 (never NaN for a finite x)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def pow2_scale(amax: torch.Tensor, inv_max: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2(amax * inv_max))`` from the fp32 bits of the product: its exponent, one
    more when any mantissa bit is set (the reference's ``fast_round_scale``)."""
    bits = (amax.float() * inv_max.to(amax.device)).contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"the last dim ({x.shape[-1]}) must be a multiple of {block}")
    return x.float().unflatten(-1, (-1, block))


def act_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values ``[..., K]`` and their fp32 power-of-two scales ``[..., K / block]``."""
    g = _blocks(x, block)
    scale = pow2_scale(g.abs().amax(-1).clamp_min(1e-4), _INV_E4M3_MAX)
    return to_e4m3(g / scale.unsqueeze(-1)).flatten(-2), scale


class _StraightThrough(torch.autograd.Function):
    """Training through a rounding point: the rounded value forward, the gradient as it is
    backward (the rounding's own gradient is zero almost everywhere)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rounding) -> torch.Tensor:
        return rounding(x)  # grad mode is off here

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _training(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def act_roundtrip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``act_quant`` dequantised, in ``x``'s dtype (the window KV's FP8 round trip); one launch
    on CUDA (``engramrt.kernels.quant_roundtrip``)."""
    if _training(x):
        return _StraightThrough.apply(x, lambda t: act_roundtrip(t, block))
    if block == 32 and use_triton(x.device):
        from engramrt.kernels.quant_roundtrip import ACT, roundtrip

        return roundtrip(x, ACT)
    q, scale = act_quant(x, block)
    return (q.float().unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


def fp4_quant(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes ``[..., K]`` and fp32 scales ``[..., K / block]``: blocks of 16 with E4M3
    scales (``E4M3_SCALE``), or of 32 with power-of-two scales (``POW2_SCALE``)."""
    if kind == E4M3_SCALE:
        g = _blocks(x, 16)
        amax = g.abs().amax(-1).clamp_min(E2M1_MAX * 2**-9)  # no all-zero block's scale is 0
        scale = to_e4m3(amax / E2M1_MAX).float()
    elif kind == POW2_SCALE:
        g = _blocks(x, 32)
        scale = pow2_scale(g.abs().amax(-1).clamp_min(E2M1_MAX * 2**-126), _INV_E2M1_MAX)
    else:
        raise ValueError(f"unknown FP4 scale kind {kind!r}")
    v = (g / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    return e2m1_codes(v).flatten(-2), scale


def fp4_roundtrip(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``fp4_quant`` dequantised, in ``x``'s dtype; one launch on CUDA."""
    if _training(x):
        return _StraightThrough.apply(x, lambda t: fp4_roundtrip(t, kind))
    if use_triton(x.device) and kind in (E4M3_SCALE, POW2_SCALE):  # else: the error below
        from engramrt.kernels.quant_roundtrip import FP4_E4M3, FP4_POW2, roundtrip

        return roundtrip(x, FP4_E4M3 if kind == E4M3_SCALE else FP4_POW2)
    codes, scale = fp4_quant(x, kind)
    block = x.shape[-1] // scale.shape[-1]
    values = decode_e2m1(codes).unflatten(-1, (-1, block)) * scale.unsqueeze(-1)
    return values.flatten(-2).to(x.dtype)


# --- weights as the checkpoint stores them ------------------------------------------------------


def dequant_fp4_weight(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """A routed expert's FP4 weight as stored (I8 ``[out, in / 2]``, two E2M1 codes a byte)
    with its E8M0 scales ``[out, in / 32]`` as ``dtype`` values (exact in bf16)."""
    out_f, half = weight.shape
    if tuple(scale.shape) != (out_f, 2 * half // 32):
        raise ValueError(
            f"an FP4 weight [{out_f}, {2 * half}] needs scales "
            f"[{out_f}, {2 * half // 32}], got {list(scale.shape)}"
        )
    values = unpack_e2m1(weight).unflatten(-1, (-1, 32)) * decode_e8m0(scale).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def quantized_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as the reference's FP8/FP4 linears compute it: ``x`` through
    ``act_quant`` first, then products of exactly representable values accumulated in fp32,
    out in ``x``'s dtype. ``weight``: dequantised (``dequant_fp8_weight`` /
    ``dequant_fp4_weight``); the products are the reference's, only the order of the fp32
    sums differs from its per-32 blocks (at most a bf16 ulp of the output, rarely)."""
    a = act_roundtrip(x).float()
    return (a @ weight.float().T).to(x.dtype)


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Normal fp32 powers of two as E8M0 (``float8_e8m0fnu``): their exponent field."""
    return ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[out, in]`` in the released FP8 format: E4M3 values and, per 32 x 32 block, the
    E8M0 scale ``2**ceil(log2(amax / 448))`` (what checkpoint writers and tests store)."""
    out_f, in_f = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -in_f % 32, 0, -out_f % 32))
    blocks = padded.unflatten(0, (-1, 32)).unflatten(-1, (-1, 32))  # [O, 32, I, 32]
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(2.0**-100)
    scale = pow2_scale(amax, _INV_E4M3_MAX)
    full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)[:out_f, :in_f]
    return to_e4m3(w.float() / full), _e8m0_bytes(scale)


def fp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[out, in]`` in the released FP4 expert format: I8 bytes of two E2M1 codes and
    an E8M0 scale per 32 inputs, ``2**ceil(log2(amax / 6))``."""
    g = _blocks(w, 32)
    scale = pow2_scale(g.abs().amax(-1).clamp_min(2.0**-100), _INV_E2M1_MAX)
    codes = e2m1_codes((g / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2)
    return pack_e2m1(codes), _e8m0_bytes(scale)


# rows an expert averages in the largest V4.1 step a CUDA graph captures (``V41MoE.grouped_tokens``)
STORED_KERNEL_ROWS = 64


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t`` is and how often it was written (inference tensors count no writes)."""
    return t.data_ptr(), -1 if t.is_inference() else t._version


class StoredLinear(nn.Module):
    """A linear layer's weight in the checkpoint's format, kept so in memory: FP8 E4M3 with
    32 x 32 E8M0 block scales, or FP4 (I8, two E2M1 codes a byte) with an E8M0 scale per 32;
    dequantised for each use (the torch path; a CPU keeps the decoded copy until the stored
    bytes change), read as held by the GPU kernel (FP4 bytes paired first: ``pair``)."""

    def __init__(
        self,
        out_features: int,
        in_features: int,
        fp4: bool = False,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ):
        """``rows`` / ``cols``: the ``[lo, hi)`` of the output / input features a tensor-parallel
        rank holds (multiples of 32, so that it reads whole scale blocks: ``shards``)."""
        super().__init__()
        self.fp4 = fp4
        self.shards = {}
        for dim, span in ((0, rows), (1, cols)):
            if span is None:
                continue
            lo, hi = span
            if lo % 32 or hi % 32:
                raise ValueError(
                    f"a tensor-parallel slice [{lo}, {hi}) of an FP8/FP4 weight "
                    "must lie on its 32-wide scale blocks"
                )
            packed = 2 if fp4 and dim == 1 else 1  # two FP4 codes a byte along the inputs
            per_scale = 1 if fp4 and dim == 0 else 32  # FP4: a scale per row and 32 inputs
            self.shards = {
                **self.shards,
                "weight": (dim, lo // packed, hi // packed),
                "scale": (dim, lo // per_scale, hi // per_scale),
            }
            if dim == 0:
                out_features = hi - lo
            else:
                in_features = hi - lo
        if fp4:
            weight = torch.zeros(out_features, in_features // 2, dtype=torch.int8)
            scale = torch.zeros(out_features, in_features // 32, dtype=torch.uint8)
        else:
            weight = torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn)
            scale = torch.zeros(-(-out_features // 32), -(-in_features // 32), dtype=torch.uint8)
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.view(torch.float8_e8m0fnu))
        self.paired = False  # FP4 bytes in the kernel's order (``pair``); saved as stored
        self.register_state_dict_post_hook(_saved_as_stored)
        self.register_load_state_dict_pre_hook(_loaded_as_held)
        self.master: nn.Parameter | None = None
        self.rounded: torch.Tensor | None = None
        self._kept: tuple[tuple, torch.Tensor] | None = None  # the CPU's decoded copy, by version

    def pair(self, checked: bool = False) -> None:
        """FP4: the weight's nibbles in the order the GPU kernel reads (``pair_fp4``), once,
        at the first use on a GPU (the MoE's, as it stacks its experts in the warm-up at load).
        ``checked``: the caller checks the scales (the MoE: once over its stacks)."""
        if self.fp4 and not self.paired:
            if not checked:
                check_fp4_scales(self.scale)
            self.weight = pair_fp4(self.weight)
            self.paired = True

    def make_trainable(self) -> None:
        """Training (``engramrt.bundled.train``): an fp32 master copy of the weight, which
        ``round_masters`` rounds to the stored format before each forward, so that what is
        trained is what is served. ``store`` writes it back."""
        self.master = nn.Parameter(self.dequantized(torch.float32))

    def store(self) -> None:
        """The master weight in the stored format (as the checkpoint keeps it); no master left."""
        w = self.master.detach()
        self.weight, self.scale = fp4_weight(w) if self.fp4 else fp8_weight(w)
        self.master = self.rounded = None
        self.paired = False

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.master is not None:
            if self.rounded is None:
                raise RuntimeError("a trainable StoredLinear needs round_masters before a forward")
            return self.rounded.to(dtype)
        key = (dtype, *map(_stamp, (self.weight, self.scale)))
        if self._kept is not None and self._kept[0] == key:
            return self._kept[1]
        decode = dequant_fp4_weight if self.fp4 else dequant_fp8_weight
        w = decode(unpair_fp4(self.weight) if self.paired else self.weight, self.scale, dtype)
        if w.device.type == "cpu":  # a CPU runs small models: decoding each step was half its time
            self._kept = (key, w)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., K], or on a GPU its ``shared_input`` codes [T, K]."""
        from engramrt.kernels.stored_linear import Codes, stored_linear  # the bytes as held

        if not isinstance(x, Codes) and (not use_triton(x.device) or self.master is not None):
            return quantized_linear(x, self.dequantized(x.dtype))
        self.pair()
        if isinstance(x, Codes):
            return stored_linear(x, self.weight, self.scale, self.fp4)
        shape = x.shape
        y = stored_linear(x.reshape(-1, shape[-1]), self.weight, self.scale, self.fp4)
        return y.view(*shape[:-1], -1)


def stack_outputs(a: StoredLinear, b: StoredLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """``a``'s weight and scale above ``b``'s, for one launch over both (they read one input);
    each layer's tensors are views of the stack after (one copy in memory). ``a``'s features
    must fill whole 32-row scale blocks (FP8)."""
    stacked = []
    for name in ("weight", "scale"):
        top = getattr(a, name)
        both = torch.cat([top, getattr(b, name)])
        setattr(a, name, both[: len(top)])
        setattr(b, name, both[len(top) :])
        stacked.append(both)
    return stacked[0], stacked[1]


def _saved_as_stored(module: StoredLinear, state: dict, prefix: str, local_metadata) -> None:
    """A paired FP4 weight goes into a state dict in the checkpoint's order."""
    if module.paired:
        state[prefix + "weight"] = unpair_fp4(state[prefix + "weight"])


def _loaded_as_held(module: StoredLinear, state: dict, prefix: str, *rest) -> None:
    """A checkpoint's FP4 weight loaded into a paired layer is paired first, and on 16 bytes."""
    name = prefix + "weight"
    if name not in state:
        return
    if module.paired:
        state[name] = pair_fp4(state[name])
    state[name] = on_16_bytes(state[name])


def on_16_bytes(weight: torch.Tensor) -> torch.Tensor:
    """``weight``, or a copy where it does not start on 16 bytes (a CPU's view into a
    safetensors file): the kernel reads stored weights by TMA (``stored_linear``)."""
    return weight.clone() if weight.data_ptr() % 16 else weight


def grouped_linear(x: torch.Tensor, layer: nn.Module, groups: int) -> torch.Tensor:
    """``x`` [T, G, K] through ``layer``'s weight [G * N, K] a group at a time: V4.1's
    ``wo_a``, an einsum over a bf16 weight in the reference (its ``convert.py`` dequantises
    the released FP8). A dense layer's weight as it is; a ``StoredLinear``'s (FP8 as released,
    ``ModelFamily.stored_linear``) read as stored on a GPU, half the bytes: the same exact
    products, summed in a fixed order whatever the step's rows; dequantised elsewhere."""
    if not isinstance(layer, StoredLinear):
        return linear(x, layer.weight.unflatten(0, (groups, -1)))
    if use_triton(x.device) and x.dtype == torch.bfloat16 and not _training(x):
        from engramrt.kernels.stored_linear import grouped_values_linear

        return grouped_values_linear(x, layer.weight, layer.scale, groups)
    return linear(x, layer.dequantized(x.dtype).unflatten(0, (groups, -1)))


def shared_input(x: torch.Tensor, inputs=None, values: bool = False):
    """``x`` [T, K] as the stored-format linears it feeds read it: on a GPU its ``act_quant``
    codes (with ``values``, the round trip's bf16 values too: FP4 weights), made once for all
    of them (``StoredLinear`` takes either), or taken from ``inputs`` (``mhc_fused.NormInputs``:
    made by the norm's launch before, the same bits); ``x`` elsewhere."""
    if not use_triton(x.device) or _training(x):
        return x
    from engramrt.kernels.stored_linear import Codes, quantize

    if inputs is not None and (inputs.values is not None or not values):
        return Codes(inputs.codes, inputs.scale, x.dtype, inputs.values)
    return quantize(x, values)


def normed_input(x: torch.Tensor, norm: nn.Module):
    """``shared_input(norm(x))`` (``norm`` an ``RMSNorm``): on a GPU the norm and ``act_quant``
    in one launch, the same codes (the normalised row itself is never written)."""
    from engramrt.kernels import rms_norm as kernel

    if (
        not use_triton(x.device)
        or _training(x)
        or x.shape[-1] % 32
        or x.shape[-1] > kernel.MAX_WIDTH
    ):
        return shared_input(norm(x))
    from engramrt.kernels.stored_linear import Codes

    return Codes(*kernel.rms_norm_codes(x, norm.weight, norm.eps), x.dtype)


def _stored_values(w: torch.Tensor, fp4: bool) -> torch.Tensor:
    if fp4:
        return dequant_fp4_weight(*fp4_weight(w), w.dtype)
    return dequant_fp8_weight(*fp8_weight(w), w.dtype)


def round_masters(layers: list[StoredLinear]) -> None:
    """Training: every trainable layer's master rounded to its stored format (``.rounded``),
    with gradients straight through; the masters of one format and input width in one call
    (a forward's few hundred weights in a few dozen launches: FP8 rows stacked whole 32-row
    blocks at a time, FP4 blocks lie within a row)."""
    groups: dict[tuple, list[StoredLinear]] = {}
    for m in layers:
        rows, cols = m.master.shape
        whole = m.fp4 or rows % 32 == 0
        groups.setdefault((m.fp4, cols) if whole else (id(m),), []).append(m)
    for members in groups.values():
        fp4 = members[0].fp4
        stacked = torch.cat([m.master for m in members])
        rounded = _StraightThrough.apply(stacked, lambda w, fp4=fp4: _stored_values(w, fp4))
        for m, r in zip(members, rounded.split([len(m.master) for m in members]), strict=True):
            m.rounded = r
