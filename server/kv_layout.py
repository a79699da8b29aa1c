"""The hetero backend's KV cache under layered KV sparsity (hetcore/kv_policy.py): its geometry for the
block manager and its attention worker. A block id holds `layout.slots` layers' rows (one layer
group's), so a cache of the same bytes has num_layers / slots times the block ids of a full one."""
from __future__ import annotations

from cpu_attn.calibrate import OakenThresholds
from cpu_attn.kv_store import OakenKVStore, layered_bytes_per_block, layered_stores
from cpu_attn.layered_worker import LayeredAttentionWorker, LayeredChunkLayout
from cpu_attn.worker import ChunkLayout
from hetcore.backend import KVCapacityError, KVSpec, SeqChunk
from hetcore.kv_policy import KVLayout
from server.backend_config import BackendConfig


def kv_layout(config: BackendConfig, cfg) -> KVLayout:
    """The layer groups of `cfg`'s model under config.kv_policy (raises KVPolicyError, one line)."""
    longest = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    return config.kv_policy.layout(cfg.num_layers, longest)


def layered_kv_spec(config: BackendConfig, cfg, capacity_bytes: int | None = None) -> KVSpec:
    """The blocks of a layered cache of `capacity_bytes` (default: config.kv_capacity_bytes)."""
    layout = kv_layout(config, cfg)
    capacity = config.kv_capacity_bytes if capacity_bytes is None else capacity_bytes
    per_block = layered_bytes_per_block(config.kv_format, layout.slots, cfg.num_kv_heads, cfg.head_dim,
                                        config.block_size, config.oaken_sparse_fraction)
    # Oaken's full-precision tails: recent_blocks a layer, in every group's store
    tails = OakenKVStore.tail_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size,
                                    config.oaken_recent_blocks) if config.kv_format == "oaken" else 0
    spec = KVSpec(config.block_size, max(0, capacity - tails) // per_block, per_block, kv_layout=layout)
    if spec.num_blocks < layout.num_groups:
        raise KVCapacityError(f"KV capacity {capacity / 2**20:.1f} MiB has room for {spec.num_blocks} blocks of "
                              f"{per_block} B beside {tails / 2**20:.1f} MiB of tails, fewer than the "
                              f"{layout.num_groups} layer groups: raise --kv-cache-bytes")
    return spec


def layered_attention_worker(config: BackendConfig, cfg, num_blocks: int, cal: OakenThresholds | None = None
                             ) -> LayeredAttentionWorker:
    """The attention worker of a layered cache of `num_blocks` blocks (cal: the Oaken calibration, for oaken)."""
    layout = kv_layout(config, cfg)
    stores = layered_stores(config.kv_format, layout.slots, layout.num_groups, cfg.num_kv_heads, cfg.head_dim,
                            config.block_size, num_blocks, cal, config.oaken_sparse_fraction,
                            config.oaken_recent_blocks)
    return LayeredAttentionWorker(stores, cfg.head_dim, layout)


def layered_chunk_layout(layout: ChunkLayout, chunk: SeqChunk) -> ChunkLayout:
    """`layout` with the chunk's rows in the later layer groups, when it has them."""
    if chunk.kv_view is None:
        return layout
    return LayeredChunkLayout(**vars(layout), kv_view=chunk.kv_view)

