"""The DeepSeek-V4.1 family: its sparse latent attention in four layer roles with compressed
caches, index keys and window rings (``attention``, ``cache``), its MoE with FP4 experts
(``moe``), FP8/FP4 stored formats and rounding points (``quant``), the DSpark draft stages
(``dspark``), and the config that derives every layer's role (``config``). The engine sees it
only through ``DeepSeekV41``, its ``ModelFamily``."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from engramrt.config import ConfigError, ModelConfig, int_field, shared_config
from engramrt.config_base import text_config
from engramrt.model.family import ModelFamily
from engramrt.models.deepseek_v41 import attention, dspark, images, quant, vision
from engramrt.models.deepseek_v41 import cache as v41_cache
from engramrt.models.deepseek_v41.attention import V41Attention
from engramrt.models.deepseek_v41.config import V41Config, v41_config
from engramrt.models.deepseek_v41.moe import V41MoE
from engramrt.tensor_parallel import TensorParallel

# stored tensors nothing runs: DSpark stages (unless it drafts with them)
DSPARK = "DSpark draft stages (mtp.*): no --speculative-config method 'dspark'"
# training scores a whole step's queries at once (a python loop over the serving default's
# 256-query chunks dominated a training step's time on a GPU)
TRAIN_QUERY_CHUNK = 1 << 16


class DeepSeekV41(ModelFamily):
    name = "deepseek_v41"
    stored_formats = True

    def config(self, raw: Mapping[str, Any]) -> ModelConfig:
        """Its attention and MoE fields in both spellings (``body``); one shared latent of
        ``head_dim`` is every head's K and V."""
        v = v41_config(raw)
        if v.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts must be 1 for V4.1, got {v.n_shared_experts}")
        if v.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {v.head_dim}")
        if not 0 < v.n_activated_experts <= v.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok must lie in [1, n_routed_experts={v.n_routed_experts}], "
                f"got {v.n_activated_experts}"
            )
        max_pos = int_field(text_config(raw), "max_position_embeddings", "max_seq_len")
        return shared_config(raw, self, v, v.dim, v.n_layers, v.norm_eps, max_pos)

    def layer(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel
    ) -> tuple[nn.Module, nn.Module]:
        v: V41Config = cfg.body
        if layer_id >= cfg.num_layers:  # a DSpark stage
            return (
                dspark.DSparkAttention(v, v.role(layer_id), dtype, tp),
                V41MoE(v.stage_moe(), tp=tp),
            )
        moe = V41MoE(v, image_bias=v.vision is not None, tp=tp)
        return V41Attention(v, v.roles[layer_id], dtype, tp), moe

    def head_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # as the reference: logits straight out in fp32

    # -- DSpark ---------------------------------------------------------------------------
    def draft_stages(self, cfg: ModelConfig) -> list[int]:
        return cfg.body.dspark_stages

    def draft_block(self, cfg: ModelConfig) -> int:
        return cfg.body.dspark_block_size

    def draft_targets(self, cfg: ModelConfig) -> tuple[int, ...]:
        return cfg.body.dspark_target_layer_ids

    def check_drafting(self, cfg: ModelConfig, layer_ids: list[int]) -> None:
        """DSpark drafts on the last pipeline stage, which must hold the target layers (their
        features feed the stages' rings in the same forward)."""
        v: V41Config = cfg.body
        if not v.dspark_stages:
            super().check_drafting(cfg, layer_ids)
        need = sorted({*v.dspark_target_layer_ids, cfg.num_layers - 1} - set(layer_ids))
        if need:
            raise ValueError(
                f"DSpark drafts on the last pipeline stage, which must hold its target "
                f"layers {list(v.dspark_target_layer_ids)}: this one lacks layers "
                f"{need} (cut after layer {min(v.dspark_target_layer_ids)} at the "
                "latest)"
            )

    def finish_draft_stage(
        self, block: nn.Module, cfg: ModelConfig, stage: int, dtype: torch.dtype
    ) -> None:
        dspark.stage_parts(block, cfg, stage, dtype)

    def seed_drafts(self, model, ctx) -> None:
        dspark.seed(model, ctx)

    def draft(self, model, cache, *args: Any, **kw: Any) -> dspark.Drafts:
        return dspark.draft(model, cache, *args, **kw)

    # -- pipeline parallelism -------------------------------------------------------------
    def legal_cuts(self, cfg: ModelConfig) -> list[int]:
        return cfg.body.legal_cuts()

    def cut_rule(self, cfg: ModelConfig, edge: int) -> str:
        return (
            f"a pipeline stage of this V4.1 model cannot start or end at layer {edge}: a "
            "stage boundary must lie where no later layer reads a compressed cache, index "
            "keys, candidate blocks or top-k written before it; legal cuts are before "
            f"layers {cfg.body.legal_cuts()}"
        )

    # -- caches ---------------------------------------------------------------------------
    def new_cache(self, model, num_blocks, block_size, max_len, num_slots, snapshots, slack):
        if snapshots is None:
            snapshots = self.default_snapshots(num_slots)
        return v41_cache.V41Cache(
            model.cfg.body,
            model.cache_layer_ids,
            num_blocks,
            block_size,
            model.dtype,
            next(model.parameters()).device,
            max_len,
            num_slots,
            snapshots,
            slack,
        )

    def block_bytes(self, model, layers: list[int], block_size: int) -> int:
        """Compressed KV and index keys: a fraction of a row a token."""
        size = model.dtype.itemsize
        return max(1, math.ceil(block_size * v41_cache.entry_bytes(model.cfg.body, layers, size)))

    def slot_bytes(self, model, layers, slots, snapshots, slack) -> int:
        """Window rings and compressor tails: per slot, not per block."""
        size = model.dtype.itemsize
        return v41_cache.fixed_bytes(model.cfg.body, layers, size, slots, snapshots, slack)

    def default_snapshots(self, slots: int) -> int:
        return v41_cache.default_snapshots(slots)

    def decode_read_bytes(self, model, context: int) -> int:
        """The window, the picked rows and the index keys scanned."""
        size = model.dtype.itemsize
        return v41_cache.read_bytes(model.cfg.body, model.layer_ids, context, size)

    def check_cache(self, cfg: ModelConfig, cache, drafts: int) -> None:
        window = cfg.body.window_size
        if cache.ring_len < window + drafts or cache.tail_rows < drafts // 2 + 1:
            raise ValueError(
                f"a V4.1 cache for {drafts} drafts a step needs rings of window + {drafts} rows "
                "and tails of K / 2 + 1 (allocate_kv's slack)"
            )

    # -- checkpoints ----------------------------------------------------------------------
    def optional_scales(self, model) -> set[str]:
        """The grouped output projection ``wo_a``: FP8 as released (held so: ``stored_linear``),
        dense in a checkpoint that gives it without scales (the bundled model's)."""
        stages = {f"mtp.{s}.attn.wo_a.scale" for s in range(len(model.mtp or []))}
        return stages | {f"layers.{i}.attn.wo_a.scale" for i in model.layer_ids}

    def stored_linear(self, weight: torch.Tensor, scale: torch.Tensor) -> nn.Module:
        """As the released checkpoint stores it: the Engram's ``wkv`` (FP8 read by the
        stored-format kernel on a GPU, ``act_quant`` first as the reference does) and ``wo_a``
        (its bf16 input as it is: ``quant.grouped_linear``)."""
        out_f, in_f = weight.shape
        layer = quant.StoredLinear(out_f, in_f)
        if scale.element_size() != 1 or scale.shape != layer.scale.shape:
            raise ValueError(
                f"an FP8 weight {[out_f, in_f]} needs E8M0 scales {list(layer.scale.shape)}, "
                f"got {scale.dtype} {list(scale.shape)}"
            )
        layer.weight, layer.scale = quant.on_16_bytes(weight), scale.view(torch.float8_e8m0fnu)
        return layer

    def unrun_reason(self, name: str, dspark: bool) -> str | None:
        """The DSpark stages without DSpark; with it, their copies of the shared embedding and
        head (``mtp.i.embed``, ``mtp.i.head``: the reference registers them, its converter
        skips them) and their image-span routing biases."""
        if not name.startswith("mtp."):
            return None
        if not dspark:
            return DSPARK
        if name.split(".")[2] in ("embed", "head"):
            return "the DSpark stages' copies of the shared embedding and head"
        if name.endswith(".ffn.gate.bias_vl"):  # the reference's drafts route as text
            return "the DSpark stages' image-span routing biases (drafts are text)"
        return None

    # -- start-up -------------------------------------------------------------------------
    def check_options(self, cfg: ModelConfig, block_size: int, stages: list[list[int]]) -> None:
        if block_size % 2:
            raise ValueError(
                f"--block-size must be even for V4.1 (ratio-2 groups), got {block_size}"
            )
        super().check_options(cfg, block_size, stages)

    def check_tensor_parallel(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        """Attention output groups and expert features, as ``layer`` splits them."""
        v: V41Config = cfg.body
        tp.span(v.o_groups, "o_groups")
        tp.span(v.moe_inter_dim, "moe_intermediate_size")

    def refuses_images(self) -> bool:
        return True

    def attach_images(self, model, dtype: torch.dtype) -> None:
        """The vision tower, its aligner and the span's learned rows, where the config has a
        tower (``vision.attach``)."""
        if model.cfg.body.vision is not None:
            vision.attach(model, model.cfg.body.vision, dtype)

    def encode_image(self, model, ref) -> torch.Tensor:
        """The fitted pixels cut into patches, through the tower and the aligner, between the
        span's learned rows (``vision.encode``)."""
        if getattr(model, "vision", None) is None:
            raise ValueError("this V4.1 checkpoint has no vision tower (no vision_config)")
        grid = images.ImageGrid(*ref.grid)
        pixels = torch.frombuffer(bytearray(ref.pixels), dtype=torch.uint8)
        pixels = pixels.view(grid.height, grid.width, 3).to(model.image_start.device)
        return vision.encode(model, images.to_patches(pixels, grid.patch), grid)

    def capture_limit(self, model, max_tokens: int) -> int | None:
        """V4.1's steps are captured up to ``V41MoE.grouped_tokens`` tokens (the grouped
        launches are graph-safe at any size; the bound keeps start-up's captures few until
        mixed steps are captured up to the token budget); a larger step runs eagerly."""
        moe = [m.grouped_tokens for m in model.modules() if isinstance(m, V41MoE)]
        if moe and max_tokens > min(moe):
            max_tokens = min(moe)
            print(
                f"engramrt: V4.1 mixed steps of more than {max_tokens} tokens run eagerly",
                flush=True,
            )
        return max_tokens

    def warm_up(self, model) -> None:
        """Every per-expert row count (``V41MoE.warm_up``)."""
        for moe in model.modules():
            if isinstance(moe, V41MoE):
                moe.warm_up(model.dtype)

    # -- training -------------------------------------------------------------------------
    def stored_linears(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, quant.StoredLinear)]

    def stored_weight(self, w: torch.Tensor, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return quant.fp4_weight(w) if fp4 else quant.fp8_weight(w)

    def round_masters(self, model: nn.Module) -> None:
        quant.round_masters([m for m in self.stored_linears(model) if m.master is not None])

    @contextmanager
    def training(self) -> Iterator[None]:
        chunk, attention.QUERY_CHUNK = attention.QUERY_CHUNK, TRAIN_QUERY_CHUNK
        try:
            yield
        finally:
            attention.QUERY_CHUNK = chunk
