"""Wire protocol: the frame layout, the versioned header and the message kinds.

See :mod:`actorrpc.protocol._wire` for the specification.
"""

from ._wire import (
    FLAG_RELEASES,
    FLAG_SHARED_MEMORY,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    RESPONSE_KINDS,
    Header,
    MessageKind,
    decode_header,
    encode_header,
)

__all__ = [
    "FLAG_RELEASES",
    "FLAG_SHARED_MEMORY",
    "HEADER_SIZE",
    "MAGIC",
    "PROTOCOL_VERSION",
    "RESPONSE_KINDS",
    "Header",
    "MessageKind",
    "decode_header",
    "encode_header",
]
