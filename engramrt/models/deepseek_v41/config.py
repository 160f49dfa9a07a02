"""DeepSeek-V4.1's attention and MoE configuration, read in both spellings (the reference's
``inference/config.json`` keys and the HF ``text_config`` names), and the role of every layer
derived from it: what each layer computes and whose caches it reads.

Roles (Flash's layers in brackets; ``tests/model/test_v41_config.py`` reads them from Flash's
released config):

- ``window``: ratio 0, its own sliding window only [0, 1; the DSpark stages];
- ``source``: a KV source, ratio 2 or 1: a compressor (gated at ratio 2) writing a compressed
  cache, its own index keys, a full indexer scan [2, 8, 14, 20]; the candidate source among them
  (ratio 1) also builds the candidate blocks [20];
- ``reindex``: an index source that is no KV source: it scores, with the latest source's index
  keys, only the positions inside the candidate blocks [24, 28, 32, 36];
- ``reuse``: its window, the latest source's compressed cache and the latest published top-k
  [3-7, 9-13, 15-19, 21-23, ...].

A pipeline cut before layer ``L`` is legal only where no layer from ``L`` on reads a cache, index
keys, candidates or a top-k that a layer before ``L`` wrote (``legal_cuts``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from engramrt.config_base import ConfigError, text_config
from engramrt.models.deepseek_v41.images import VisionConfig

WINDOW, SOURCE, REINDEX, REUSE = "window", "source", "reindex", "reuse"


# the HF ``text_config`` name of each field whose reference name differs
HF_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "norm_eps": "rms_norm_eps",
    "original_seq_len": "rope_scaling.original_max_position_embeddings",
    "rope_factor": "rope_scaling.factor",
    "beta_fast": "rope_scaling.beta_fast",
    "beta_slow": "rope_scaling.beta_slow",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_activated_experts": "num_experts_per_tok",
    "moe_inter_dim": "moe_intermediate_size",
    "route_scale": "routed_scaling_factor",
    "score_func": "scoring_func",
}


def _field(cfg: Mapping[str, Any], ref: str, default: Any = ...) -> tuple[str, Any]:
    """(the HF name, the value) of a field given in either spelling; both given and different
    is an error naming both."""
    hf = HF_NAMES.get(ref, ref)
    here = [k for k in dict.fromkeys((ref, hf)) if k in cfg]
    if len(here) == 2 and cfg[ref] != cfg[hf]:
        raise ConfigError(
            f"config fields {ref!r} ({cfg[ref]!r}) and {hf!r} ({cfg[hf]!r}) "
            "name the same thing and disagree"
        )
    if here:
        return hf, cfg[here[0]]
    if default is ...:
        raise ConfigError(f"config field {hf!r} (or {ref!r}) is missing")
    return hf, default


def _int(cfg, ref: str, default: Any = ..., low: int = 1) -> int:
    hf, value = _field(cfg, ref, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"config field {hf!r} must be an integer >= {low}, got {value!r}")
    return value


def _ints(cfg, ref: str) -> tuple[int, ...]:
    hf, value = _field(cfg, ref)
    if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise ConfigError(f"config field {hf!r} must be a list of integers >= 0, got {value!r}")
    return tuple(value)


def _float(cfg, ref: str) -> float:
    hf, value = _field(cfg, ref)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"config field {hf!r} must be a number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LayerRole:
    layer: int
    ratio: int  # tokens per compressed entry (0: no compressed cache read)
    kind: str  # WINDOW, SOURCE, REINDEX or REUSE
    kv_source: int | None  # the layer whose compressed cache it reads
    index_source: int | None  # the layer whose index keys it scores with (its own: a source)
    topk_from: int | None  # the layer whose top-k it reads (itself when it runs an indexer)
    builds_candidates: bool = False
    candidates_from: int | None = None  # a re-indexing layer: the candidate source's blocks

    @property
    def reads(self) -> set[int]:
        """Layers whose state this one reads (its own included)."""
        return {
            s
            for s in (self.kv_source, self.index_source, self.topk_from, self.candidates_from)
            if s is not None
        }


@dataclass(frozen=True)
class V41Config:
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]  # per backbone layer, then per DSpark stage
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    original_seq_len: int
    rope_factor: float
    beta_fast: float
    beta_slow: float
    norm_eps: float
    n_mtp_layers: int  # DSpark stages (``mtp.*``): recognised, not run yet
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    route_scale: float
    swiglu_limit: float
    roles: tuple[LayerRole, ...] = ()
    # DSpark (``engramrt.models.deepseek_v41.dspark``): a block of ``dspark_block_size`` drafts a
    pass
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0  # 0: the backbone's counts
    dspark_n_activated_experts: int = 0
    vision: VisionConfig | None = None  # the vision tower (``vision``); None: text only

    @property
    def dspark_stages(self) -> list[int]:
        """The DSpark stages' layer ids (``mtp.s`` is layer ``n_layers + s``); none without
        a draft block."""
        return (
            list(range(self.n_layers, self.n_layers + self.n_mtp_layers))
            if self.dspark_block_size
            else []
        )

    def role(self, layer: int) -> LayerRole:
        """A backbone layer's role, or a DSpark stage's (its own window only)."""
        if layer < self.n_layers:
            return self.roles[layer]
        return LayerRole(layer, 0, WINDOW, None, None, None)

    def stage_moe(self) -> V41Config:
        """The config a DSpark stage's MoE reads: its own expert counts."""
        return replace(
            self,
            n_routed_experts=self.dspark_n_routed_experts or self.n_routed_experts,
            n_activated_experts=self.dspark_n_activated_experts or self.n_activated_experts,
        )

    def legal_cuts(self) -> list[int]:
        """The layers a pipeline stage may start at (1 .. n_layers - 1): those before which no
        later layer reads what an earlier one wrote."""
        return [
            cut
            for cut in range(1, self.n_layers)
            if not any(r < cut for role in self.roles[cut:] for r in role.reads)
        ]


def v41_config(raw: Mapping[str, Any]) -> V41Config:
    """The V4.1 fields of a config (the top level or its ``text_config``), checked: every
    inconsistency is an error naming the field."""
    c = text_config(raw)
    rope = c.get("rope_scaling") or {}
    c = {**c, **{f"rope_scaling.{k}": v for k, v in rope.items()}}
    hf, score = _field(c, "score_func", "sqrtsoftplus")
    if score != "sqrtsoftplus":
        raise ConfigError(f"config field {hf!r} must be 'sqrtsoftplus' for V4.1, got {score!r}")
    ints = [
        "dim",
        "n_layers",
        "n_heads",
        "head_dim",
        "rope_head_dim",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "window_size",
        "candidate_topk_blocks",
        "candidate_block_size",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "original_seq_len",
        "n_routed_experts",
        "n_activated_experts",
        "moe_inter_dim",
    ]
    floats = [
        "rope_theta",
        "compress_rope_theta",
        "rope_factor",
        "beta_fast",
        "beta_slow",
        "norm_eps",
        "route_scale",
        "swiglu_limit",
    ]
    cfg = V41Config(
        **{name: _int(c, name) for name in ints},
        **{name: _float(c, name) for name in floats},
        **{
            name: _ints(c, name)
            for name in ("compress_ratios", "kv_source_layers", "index_source_layers")
        },
        candidate_source_layer=_int(c, "candidate_source_layer", low=0),
        n_mtp_layers=_int(c, "n_mtp_layers", default=0, low=0),
        n_shared_experts=_int(c, "n_shared_experts", low=0),
        **{
            name: _int(c, name, default=0, low=0)
            for name in (
                "dspark_block_size",
                "dspark_noise_token_id",
                "dspark_n_routed_experts",
                "dspark_n_activated_experts",
            )
        },
        dspark_markov_rank=_int(c, "dspark_markov_rank", default=256),
        dspark_target_layer_ids=tuple(_field(c, "dspark_target_layer_ids", [])[1]),
        vision=VisionConfig.from_config(dict(raw)),
    )
    _check_widths(cfg)
    return replace(cfg, roles=_roles(cfg))


def _check_widths(c: V41Config) -> None:
    def need(ok: bool, field: str, rule: str) -> None:
        if not ok:
            raise ConfigError(f"config field {field!r}: {rule}")

    need(
        c.rope_head_dim % 2 == 0 and c.rope_head_dim < c.head_dim,
        "qk_rope_head_dim",
        f"must be even and below head_dim ({c.head_dim}), got {c.rope_head_dim}",
    )
    for name, width in (
        ("head_dim", c.head_dim),
        ("hidden_size", c.dim),
        ("q_lora_rank", c.q_lora_rank),
        ("index_head_dim", c.index_head_dim),
        ("moe_intermediate_size", c.moe_inter_dim),
    ):
        need(width % 32 == 0, name, f"must be a multiple of 32 (the FP8/FP4 blocks), got {width}")
    need(
        c.n_heads * c.head_dim % c.o_groups == 0,
        "o_groups",
        f"must divide num_attention_heads x head_dim ({c.n_heads * c.head_dim})",
    )
    need(
        c.n_activated_experts <= c.n_routed_experts,
        "num_experts_per_tok",
        f"must be <= n_routed_experts ({c.n_routed_experts}), got {c.n_activated_experts}",
    )
    # the candidate blocks hold at least this many reachable positions (the newest block may be
    # partly filled); a top-k no larger never picks a masked one, so a query's picks do not
    # depend on how its prompt was chunked
    pool = (c.candidate_topk_blocks - 1) * c.candidate_block_size + 1
    need(
        c.index_topk <= pool,
        "index_topk",
        f"must be <= (candidate_topk_blocks - 1) x candidate_block_size + 1 ({pool}), got "
        f"{c.index_topk}",
    )
    want = c.n_layers + c.n_mtp_layers
    need(
        len(c.compress_ratios) in (c.n_layers, want),
        "compress_ratios",
        f"needs one entry per layer ({c.n_layers}) or per layer and DSpark stage ({want}), got "
        f"{len(c.compress_ratios)}",
    )
    if c.dspark_block_size and c.n_mtp_layers:
        targets = c.dspark_target_layer_ids
        need(
            len(targets) > 0 and all(isinstance(t, int) and 0 <= t < c.n_layers for t in targets),
            "dspark_target_layer_ids",
            f"must name backbone layers (below {c.n_layers}), got {list(targets)}",
        )
        need(
            all(r == 0 for r in c.compress_ratios[c.n_layers :]),
            "compress_ratios",
            "a DSpark stage attends over its own window only: its entries must be 0",
        )
    need(
        all(r in (0, 1, 2) for r in c.compress_ratios),
        "compress_ratios",
        f"entries must be 0, 1 or 2, got {sorted(set(c.compress_ratios))}",
    )


def _roles(c: V41Config) -> tuple[LayerRole, ...]:
    """Every backbone layer's role; an inconsistent source list is an error naming it."""
    kv, index = set(c.kv_source_layers), set(c.index_source_layers)
    for field, layers in (
        ("kv_source_layer_ids", c.kv_source_layers),
        ("index_source_layer_ids", c.index_source_layers),
    ):
        if list(layers) != sorted(set(layers)) or any(i >= c.n_layers for i in layers):
            raise ConfigError(
                f"config field {field!r} must be sorted, unique layer ids below "
                f"{c.n_layers}, got {list(layers)}"
            )
    if not kv <= index:
        raise ConfigError(
            f"config field 'kv_source_layer_ids': every KV source runs an "
            f"indexer, but {sorted(kv - index)} are not in "
            "index_source_layer_ids"
        )
    cand = c.candidate_source_layer
    if cand not in kv or c.compress_ratios[cand] != 1:
        raise ConfigError(
            f"config field 'candidate_source_layer_id' ({cand}) must be a KV source of ratio 1"
        )
    roles, source, topk = [], None, None
    for layer in range(c.n_layers):
        ratio = c.compress_ratios[layer]
        if ratio == 0:
            if layer in index:
                raise ConfigError(
                    f"config field 'index_source_layer_ids': layer {layer} has "
                    "compress ratio 0 and no cache to index"
                )
            roles.append(LayerRole(layer, 0, WINDOW, None, None, None))
            continue
        if layer in kv:
            source = topk = layer
            roles.append(
                LayerRole(
                    layer, ratio, SOURCE, layer, layer, layer, builds_candidates=layer == cand
                )
            )
            continue
        if source is None or c.compress_ratios[source] != ratio:
            raise ConfigError(
                f"config field 'compress_ratios': layer {layer} (ratio {ratio}) has "
                f"no earlier KV source of that ratio to read"
            )
        if layer in index:
            if layer < cand:
                raise ConfigError(
                    f"config field 'index_source_layer_ids': layer {layer} "
                    f"re-indexes before the candidate source {cand}"
                )
            topk = layer
            roles.append(
                LayerRole(layer, ratio, REINDEX, source, source, layer, candidates_from=cand)
            )
        else:
            roles.append(LayerRole(layer, ratio, REUSE, source, None, topk))
    return tuple(roles)
