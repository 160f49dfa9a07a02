"""The face of a model family: everything the engine, runner, commands and bundled code may ask
of a model body. The skeleton (Engram, lagged mHC, embedding, head) is shared; a family
(``engramrt.models.<family>``) supplies each layer's attention and FFN and says what its caches,
pipeline cuts, checkpoints, drafts and start-up need. Code outside a family reaches it only as
``cfg.family``: a model's differences live in one package, never in a flag read elsewhere.

The defaults here are a plain family's: no pipeline-cut rule, no draft stages, no stored low-
precision formats; a family overrides what it has."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engramrt.config import ModelConfig
from engramrt.model.context import ForwardContext, PagedCache
from engramrt.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from engramrt.runner.batch import ImageRef  # the wire's: what the stage hands the family

EngramMHCModel = nn.Module  # the decoder (``engramrt.model.decoder``), which reads its family


class ModelFamily:
    name = ""
    stored_formats = False  # weights as released in low-precision formats (FP8, FP4)

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # -- config ---------------------------------------------------------------------------
    def config(self, raw: Mapping[str, Any]) -> ModelConfig:
        """The config (shared fields and this family's ``body``); errors name the field."""
        raise NotImplementedError

    # -- layers ---------------------------------------------------------------------------
    def layer(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel
    ) -> tuple[nn.Module, nn.Module]:
        """Layer ``layer_id``'s attention and FFN (a draft stage's, past the backbone)."""
        raise NotImplementedError

    def head_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    # -- draft stages (speculative decoding's own layers) ---------------------------------
    def draft_stages(self, cfg: ModelConfig) -> list[int]:
        """The layer ids of the draft stages past the backbone (none: no such stages)."""
        return []

    def draft_block(self, cfg: ModelConfig) -> int:
        """Drafts one pass proposes."""
        return 0

    def check_drafting(self, cfg: ModelConfig, layer_ids: list[int]) -> None:
        """That a stage holding ``layer_ids`` can draft with the model's own stages."""
        raise ValueError(
            "--speculative-config method 'dspark' needs a V4.1 model with DSpark "
            "stages (num_nextn_predict_layers, dspark_block_size in its config)"
        )

    def draft_targets(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The backbone layers whose input features the draft stages read."""
        return ()

    def finish_draft_stage(
        self, block: nn.Module, cfg: ModelConfig, stage: int, dtype: torch.dtype
    ) -> None:
        """Draft stage ``stage``'s pieces beside its block."""

    def seed_drafts(self, model: EngramMHCModel, ctx: ForwardContext) -> None:
        """After a forward: what the draft stages keep of it."""

    def draft(self, model: EngramMHCModel, cache: PagedCache, *args: Any, **kw: Any) -> Any:
        """One draft pass (the family's own signature)."""
        raise NotImplementedError

    # -- pipeline parallelism -------------------------------------------------------------
    def legal_cuts(self, cfg: ModelConfig) -> list[int] | None:
        """The layers a pipeline stage may start at (None: any)."""
        return None

    def check_stage(self, cfg: ModelConfig, layer_ids: list[int]) -> None:
        """That a stage of ``layer_ids`` starts and ends where a pipeline may cut."""
        cuts = self.legal_cuts(cfg)
        if cuts is None:
            return
        legal = [0, *cuts, cfg.num_layers]
        for edge in (layer_ids[0], layer_ids[-1] + 1):
            if edge not in legal:
                raise ValueError(self.cut_rule(cfg, edge))

    def cut_rule(self, cfg: ModelConfig, edge: int) -> str:
        return f"a pipeline stage cannot start or end at layer {edge}"

    # -- caches ---------------------------------------------------------------------------
    def new_cache(
        self,
        model: EngramMHCModel,
        num_blocks: int,
        block_size: int,
        max_len: int,
        num_slots: int,
        snapshots: int | None,
        slack: int,
    ) -> PagedCache:
        raise NotImplementedError

    def block_bytes(self, model: EngramMHCModel, layers: list[int], block_size: int) -> int:
        """Bytes a cache block of ``block_size`` tokens takes over ``layers``."""
        raise NotImplementedError

    def slot_bytes(
        self, model: EngramMHCModel, layers: list[int], slots: int, snapshots: int, slack: int
    ) -> int:
        """Bytes held per sequence slot rather than per block (0: none)."""
        return 0

    def default_snapshots(self, slots: int) -> int:
        """Per-request snapshots prefix caching keeps (0: it needs none)."""
        return 0

    def decode_read_bytes(self, model: EngramMHCModel, context: int) -> int:
        """Cache bytes one request's decode step reads at ``context`` tokens."""
        raise NotImplementedError

    def check_cache(self, cfg: ModelConfig, cache: PagedCache, drafts: int) -> None:
        """That ``cache`` has room for verify runs of ``drafts`` drafts."""

    # -- checkpoints ----------------------------------------------------------------------
    def optional_scales(self, model: EngramMHCModel) -> set[str]:
        """Scales a checkpoint may give for weights this family builds as dense layers."""
        return set()

    def stored_linear(self, weight: torch.Tensor, scale: torch.Tensor) -> nn.Module | None:
        """An FP8 weight with its 32 x 32 E8M0 scales given for a dense layer (the Engram's
        ``wkv``, an ``optional_scales`` weight): the layer that replaces it holding the weight
        as stored, or None: dequantised at load."""
        return None

    def unrun_reason(self, name: str, dspark: bool) -> str | None:
        """Why a stored tensor is not loaded (None: it is)."""
        return None

    # -- start-up -------------------------------------------------------------------------
    def check_options(self, cfg: ModelConfig, block_size: int, stages: list[list[int]]) -> None:
        """What this family cannot run, as an error before anything loads."""
        for layer_ids in stages:
            self.check_stage(cfg, layer_ids)

    def check_tensor_parallel(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        """That ``tp.size`` ranks can split what the layers split among them, by the layers'
        own rules (``TensorParallel.span``) called for one rank: an error before any rank
        starts, not in each rank after it has (default: nothing split evenly)."""

    def refuses_images(self) -> bool:
        """Whether an image placeholder in a text prompt is refused (a vision family's)."""
        return False

    def attach_images(self, model: EngramMHCModel, dtype: torch.dtype) -> None:
        """On the stage that embeds the prompt: what turns an image into its span's rows
        (``EngramMHCModel.embed_tokens``), under the checkpoint's names (default: nothing)."""

    def encode_image(self, model: EngramMHCModel, ref: ImageRef) -> torch.Tensor:
        """An image's span as embedding rows ``[ref.length, D]`` (``runner.images``)."""
        raise ValueError(f"the {self.name} family takes no images")

    def capture_limit(self, model: EngramMHCModel, max_tokens: int) -> int | None:
        """The largest mixed step CUDA graphs may capture (None: decode eagerly)."""
        return max_tokens

    def warm_up(self, model: EngramMHCModel) -> None:
        """Compile what a step's shapes alone do not cover."""

    # -- training (the bundled models) ----------------------------------------------------
    def stored_linears(self, model: nn.Module) -> list[nn.Module]:
        """Linears kept in a stored low-precision format (trained through fp32 masters)."""
        return []

    def stored_weight(self, w: torch.Tensor, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``w`` in the family's stored format: codes and scales."""
        raise NotImplementedError

    def round_masters(self, model: nn.Module) -> None:
        """Stored weights rounded anew from their trained masters."""

    @contextmanager
    def training(self) -> Iterator[None]:
        """What a training step runs under beyond torch's settings."""
        yield
