"""Oaken KV quantization and exact attention over the quantized store.

    codec.py      the format: one token's K (or V) quantized and dequantized, tokens written into blocks
    turn.py       the store's Hadamard rotation of rows, and decode-step rows written into block tails
    decode.py     rows decoded to float32 (blocks still filling, MagicPIG's sampled rows, CPUs without int16)
    codes.py      int16 codes of a block's rows and of the queries, shared by the two int16 kernels
    vnni.py       a full block's scores and weighted values in AVX-512 int16 dot products
    avx2.py       the same with AVX2
    center.py     the keys' centers, added back in the score domain
    records.py    the named records the kernels take (a layer's K and V, the queries, the scratch)
    attention.py  the exact decode kernel over the store
    store.py      OakenKVStore, the paged store itself (imported by kv_store.py, not here: it uses sampled.py,
                  which uses this package)

The names below are the package's surface (kv_store.py, sampled.py, the tests and benchmarks)."""
from cpu_attn.oaken.attention import int16_add_weighted_rows, int16_block_scores, oaken_decode_attention, oaken_scratch
from cpu_attn.oaken.avx2 import avx2_add_weighted_rows, avx2_block_scores
from cpu_attn.oaken.center import (add_center_scores, add_key_center, center_codes, center_terms, decode_outputs,
                                   decode_queries, vnni_center_scores)
from cpu_attn.oaken.codec import (INNER, MIDDLE, OUTER, SEGMENT, dequantize, effective_bits, move_tokens, quantize,
                                  row_entries, write_tokens)
from cpu_attn.oaken.codes import AVX2, CODE_MAX, INT16, ROWS, VNNI, query_codes
from cpu_attn.oaken.decode import dequantize_blocks, load_block, load_row, prefetch_block
from cpu_attn.oaken.records import (DecodeQueries, KeyCenter, OakenParts, OakenScratch, RowTransform,
                                    ScoreCenter, TailSlots, TokenScratch)
from cpu_attn.oaken.turn import turn_heads, write_decode_rows
from cpu_attn.oaken.vnni import MAX_HEADS, vnni_add_weighted_rows, vnni_block_scores

__all__ = ["AVX2", "CODE_MAX", "INNER", "INT16", "MAX_HEADS", "MIDDLE", "OUTER", "ROWS", "SEGMENT", "VNNI",
           "DecodeQueries", "KeyCenter", "OakenParts", "OakenScratch", "RowTransform", "ScoreCenter",
           "TailSlots", "TokenScratch", "add_center_scores", "add_key_center", "avx2_add_weighted_rows",
           "avx2_block_scores", "center_codes", "center_terms", "decode_outputs", "decode_queries", "dequantize",
           "dequantize_blocks", "effective_bits", "int16_add_weighted_rows", "int16_block_scores", "load_block",
           "load_row", "move_tokens", "oaken_decode_attention", "oaken_scratch", "prefetch_block", "quantize",
           "query_codes", "row_entries", "turn_heads", "vnni_add_weighted_rows", "vnni_block_scores",
           "vnni_center_scores", "write_decode_rows", "write_tokens"]
