"""Message schemas and their msgpack codec: the only vocabulary actors speak.

Layer: protocols/ imports only the standard library, msgpack and numpy (no trio, no
onnxruntime, no lever_actors), so any process or language can share the wire format.

``encode(msg) -> bytes`` and ``decode(bytes) -> Message`` handle every class in ``REGISTRY``;
see ``protocols.base`` for the envelope and versioning rules and ``protocols.ndarray`` for
arrays. Importing this package registers every message class.
"""
from protocols.base import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    REGISTRY,
    BadFrame,
    FrameTooLarge,
    Message,
    ProtocolError,
    UnknownMessage,
    VersionMismatch,
    decode,
    encode,
    register,
)
from protocols.ndarray import NDARRAY_EXT, WIRE_DTYPES, pack_ndarray, unpack_ndarray
from protocols.pipeline import (
    Abort,
    Commit,
    DraftExpansion,
    DraftRequest,
    DraftSteer,
    ExitHidden,
    LaneGrant,
    LayerReady,
    LayerReleased,
    PassSchedule,
    PassStats,
    PipelineMessage,
    PruneMask,
    VerifyDone,
    VerifyPlan,
)

__all__ = [
    "Abort",
    "MAX_MESSAGE_BYTES",
    "NDARRAY_EXT",
    "PROTOCOL_VERSION",
    "REGISTRY",
    "WIRE_DTYPES",
    "BadFrame",
    "Commit",
    "DraftExpansion",
    "DraftRequest",
    "DraftSteer",
    "ExitHidden",
    "FrameTooLarge",
    "LaneGrant",
    "LayerReady",
    "LayerReleased",
    "Message",
    "PassSchedule",
    "PassStats",
    "PipelineMessage",
    "ProtocolError",
    "PruneMask",
    "UnknownMessage",
    "VerifyDone",
    "VerifyPlan",
    "VersionMismatch",
    "decode",
    "encode",
    "pack_ndarray",
    "register",
    "unpack_ndarray",
]
