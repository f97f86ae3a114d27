"""Wire protocol: the frame layout, the versioned header and the message kinds.

See :mod:`actorrpc.protocol._wire` for the specification.
"""

from ._wire import (
    FLAG_INLINE_PAYLOAD,
    FLAG_RIDERS,
    FLAG_SHARED_MEMORY,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    RESPONSE_KINDS,
    Header,
    MessageKind,
    decode_header,
    decode_riders,
    encode_header,
    encode_inline,
    encode_riders,
)

__all__ = [
    "FLAG_INLINE_PAYLOAD",
    "FLAG_RIDERS",
    "FLAG_SHARED_MEMORY",
    "HEADER_SIZE",
    "MAGIC",
    "PROTOCOL_VERSION",
    "RESPONSE_KINDS",
    "Header",
    "MessageKind",
    "decode_header",
    "decode_riders",
    "encode_header",
    "encode_inline",
    "encode_riders",
]
