"""Data plane: moves KV payloads between services; the bus carries only a TransferHandle.

``base`` defines the two-sided interface (KVSender / KVReceiver, states, errors); ``frames`` the
wire format and socket helpers; ``tcp`` the sender and receiver of frames, whose payload moves
raw or through a path module holding that path's reader: ``zstd`` (compressed), ``shm`` (a
/dev/shm segment on the same host) or ``nixl`` (the optional rdma path); ``link`` detects what a
peer's link can do and orders the paths; ``select`` is the sender services use
(``make_transport``): best path per peer, retried on the next path on failure.
"""

from shared.transfer.base import (
    ChecksumError, Discarded, KVPayload, KVReceiver, KVSender, KVTransport, NotAuthorized, PeerUnavailable, SendResult,
    TransferError, TransferState, checksum,
)
from shared.transfer.select import DataPlane, DataPlaneSender, make_transport
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender, TcpTransport

__all__ = [
    "ChecksumError", "Discarded", "KVPayload", "KVReceiver", "KVSender", "KVTransport", "NotAuthorized", "PeerUnavailable",
    "SendResult", "TransferError", "TransferState", "checksum",
    "TcpKVReceiver", "TcpKVSender", "TcpTransport", "DataPlane", "DataPlaneSender", "make_transport",
]
