"""Data plane: moves KV payloads between services; the bus carries only a TransferHandle.

``base`` defines the two-sided interface (KVSender / KVReceiver, states, errors); ``tcp`` is
v1. RDMA, shared memory and link-speed selection plug in as further KVTransport classes.
"""

from shared.transfer.base import (
    ChecksumError, KVPayload, KVReceiver, KVSender, KVTransport, PeerUnavailable, SendResult,
    TransferError, TransferState, checksum,
)
from shared.transfer.tcp import TcpKVReceiver, TcpKVSender, TcpTransport

__all__ = [
    "ChecksumError", "KVPayload", "KVReceiver", "KVSender", "KVTransport", "PeerUnavailable",
    "SendResult", "TransferError", "TransferState", "checksum",
    "TcpKVReceiver", "TcpKVSender", "TcpTransport",
]
