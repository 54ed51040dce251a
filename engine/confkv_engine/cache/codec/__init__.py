"""The codec room: pure quantization maths for KV blocks (int8/int4/int2, per-group scales).

Owns the encoding of one block and nothing else: ``spec`` (what an encoding is: bits, groups,
parameter format, bytes), ``group_quant`` (the group-wise maths), ``bitpack`` (codes into bytes) and
``blocks`` (a block's byte layout: ``encode_rows`` / ``decode_rows``). It sits below everything: it
imports torch only, never the cache core, the disk store or anything else of the engine. The cache's
compressed store (``cache.arena``) and retention's precision tiers (``cache.tiered``) both use it.

The names other rooms use are re-exported here.
"""

from confkv_engine.cache.codec.blocks import EncodedBlock, decode, decode_rows, encode, encode_rows
from confkv_engine.cache.codec.spec import CodecSpec

__all__ = ["CodecSpec", "EncodedBlock", "decode", "decode_rows", "encode", "encode_rows"]
