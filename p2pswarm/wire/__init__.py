"""Message types and their codec. Importing this package registers every message."""

from p2pswarm.wire import (
    base,  # noqa: F401  (registers tags 0-9)
    control,  # noqa: F401  (registers tags 200-208)
    gossip,  # noqa: F401  (registers tags 10-69)
    jobs,  # noqa: F401  (registers tags 150-179)
    loads,  # noqa: F401  (registers tags 77-99, 132-134)
    orders,  # noqa: F401  (registers tags 70-76)
    serving,  # noqa: F401  (registers tags 100-109, 145-147)
    training,  # noqa: F401  (registers tags 110-129, 180-199)
)
from p2pswarm.wire.codec import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    decode,
    encode,
    frame_limit,
    message,
    message_types,
    needs,
    pack_compound,
    sendable,
    struct,
    tag_of,
)

__all__ = ["PROTOCOL_MAJOR", "PROTOCOL_MINOR", "decode", "encode", "frame_limit", "message",
           "message_types", "needs", "pack_compound", "sendable", "struct", "tag_of"]
