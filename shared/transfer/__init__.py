"""Data plane: moves KV payloads between services; the bus carries only a TransferHandle.

``base`` defines the two-sided interface (KVSender / KVReceiver, states, errors); ``tcp`` moves
frames (raw, zstd-compressed, naming a ``shm`` segment on the same host, or offering memory
for a NIXL READ — ``nixl``, the optional rdma path); ``link`` detects what a peer's link can do
and orders the paths; ``select`` is the sender services use (``make_transport``): best path
per peer, retried on the next path on failure.
"""

from shared.transfer.base import (
    ChecksumError, KVPayload, KVReceiver, KVSender, KVTransport, PeerUnavailable, SendResult,
    TransferError, TransferState, checksum,
)
from shared.transfer.select import DataPlane, DataPlaneSender, make_transport
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender, TcpTransport

__all__ = [
    "ChecksumError", "KVPayload", "KVReceiver", "KVSender", "KVTransport", "PeerUnavailable",
    "SendResult", "TransferError", "TransferState", "checksum",
    "TcpKVReceiver", "TcpKVSender", "TcpTransport", "DataPlane", "DataPlaneSender", "make_transport",
]
