"""Tensor codecs: quantize and compress float tensors for the wire, and decode them totally.

Public API (other modules code against exactly this):
`CODECS`, `CODECS_BY_ID`, `encode_tensor`, `decode_tensor`, `encode_named`, `decode_named`,
`frame_body` (the message of a body encoded elsewhere, e.g. by a device twin of a scheme),
`quantize_roundtrip` (what a tensor decodes to, for error feedback), the `Codec` base class and
the decode limits. Dense schemes live in `schemes.py`, the sparse ones (`topk2`, `union8`) in
`sparse.py` with their index coding in `sparse_indices.py`, the message container and its checks
in `container.py`; the byte layout is specified in docs/CODECS.md.
"""

from wire.codecs.container import (
    CODECS,
    CODECS_BY_ID,
    FORMAT_VERSION,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_PADDING_ELEMENTS,
    MAX_TENSOR_ELEMENTS,
    MAX_TENSORS,
    decode_named,
    decode_tensor,
    encode_named,
    encode_tensor,
    frame_body,
    quantize_roundtrip,
)
from wire.codecs.schemes import MAX_BLOCK_SIZE, Codec

__all__ = [
    "CODECS",
    "CODECS_BY_ID",
    "FORMAT_VERSION",
    "MAX_BLOCK_SIZE",
    "MAX_NAME_BYTES",
    "MAX_NDIM",
    "MAX_PADDING_ELEMENTS",
    "MAX_TENSOR_ELEMENTS",
    "MAX_TENSORS",
    "Codec",
    "decode_named",
    "decode_tensor",
    "encode_named",
    "encode_tensor",
    "frame_body",
    "quantize_roundtrip",
]
