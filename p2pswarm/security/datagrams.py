"""Datagram sealing: ChaCha20-Poly1305 per (sender, epoch) subkey, and replay windows.

Datagrams are sealed with ChaCha20-Poly1305. Every fellow seals under the same swarm key,
so to keep nonces unique each (sender, epoch) gets its own subkey and the nonce is the
sender's sequence number. The epoch is chosen by the caller and must grow across restarts
(a persisted boot counter or the boot time in ns); reusing an epoch would reuse nonces.
Replays are caught per sender with a sliding window, updated only after authentication.

Epochs. Every fellow holding the swarm key can seal a datagram naming any sender and any
epoch, so a higher epoch alone proves nothing: adopting it at once would let a token
holder lock a fellow out with one forged far-future datagram. A sender therefore has a
*proven* epoch, set by ``confirm`` once a datagram of that epoch carried something the
sender signed (its own Alive naming that epoch, at an incarnation above the last proof),
and a few windows for the epochs seen since. Epochs at or above the proven one are
accepted, each in its own window (the proven one's is never evicted); a datagram below it
comes back marked ``stale``: it counts only if it proves its epoch (a restarted fellow
whose clock went backwards), else it is dropped as ``stale-epoch``.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from p2pswarm.errors import AuthenticationError, ConfigError, LocalProtocolError
from p2pswarm.security.identity import NODE_ID_BYTES
from p2pswarm.security.keyring import Keyring

__all__ = ["DatagramSealer", "OpenedDatagram"]

# _TAG_BYTES, _U64_MAX and _NONCE_PAD are shared with the stream cipher (handshake.py).
_TAG_BYTES = 16
_U64_MAX = (1 << 64) - 1

_DATAGRAM_VERSION = 1
# version, key id, sender node id, sender epoch, sequence number; all of it is the AAD.
_DATAGRAM_HEADER = struct.Struct(">B4s16sQQ")
_SEQ_OFFSET = _DATAGRAM_HEADER.size - 8
_NONCE_PAD = bytes(4)  # nonce = 4 zero bytes + the 8-byte sequence number


def _datagram_subkey(datagram_key: bytes, sender: bytes, epoch: int) -> ChaCha20Poly1305:
    # The swarm datagram key is already uniform, so HKDF-Expand alone is enough.
    info = b"p2pswarm datagram subkey" + sender + epoch.to_bytes(8, "big")
    return ChaCha20Poly1305(HKDFExpand(hashes.SHA256(), 32, info).derive(datagram_key))


class _ReplayWindow:
    """Sequence numbers seen from one sender in one epoch (bit i: ``top - i`` was seen)."""

    __slots__ = ("bitmap", "epoch", "top")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.top = -1
        self.bitmap = 0


class _Sender:
    """One sender's proven epoch (-1: none yet), the proof's incarnation, and windows."""

    __slots__ = ("proof", "proven", "windows")

    def __init__(self) -> None:
        self.proven = -1
        self.proof = -1
        self.windows: OrderedDict[int, _ReplayWindow] = OrderedDict()


class OpenedDatagram(NamedTuple):  # a tuple: opening is on every datagram's path
    sender: bytes
    epoch: int
    seq: int
    plaintext: bytes
    stale: bool  # below the sender's proven epoch: counts only if it proves its own


class DatagramSealer:
    """Seals this fellow's datagrams and opens (authenticates, de-duplicates) others'.

    ``epoch`` must grow every time this node restarts: with the same epoch the
    sequence numbers, and so the nonces, would repeat.
    """

    def __init__(
        self,
        keyring: Keyring,
        node_id: bytes,
        epoch: int,
        replay_window: int = 1024,
        *,
        max_senders: int = 4096,
        max_subkeys: int = 8192,
        max_epochs_per_sender: int = 4,
    ) -> None:
        if len(node_id) != NODE_ID_BYTES:
            raise ConfigError(f"a node id is {NODE_ID_BYTES} bytes, got {len(node_id)}")
        if not 0 <= epoch <= _U64_MAX:
            raise ConfigError(f"epoch must fit in 64 unsigned bits, got {epoch}")
        if replay_window < 1:
            raise ConfigError(f"replay window must be at least 1, got {replay_window}")
        self._keyring = keyring
        self._node_id = bytes(node_id)
        self._epoch = epoch
        self._window = replay_window
        self._window_mask = (1 << replay_window) - 1
        self._max_senders = max_senders
        self._max_subkeys = max_subkeys
        self._max_epochs = max(2, max_epochs_per_sender)  # the proven one and a newer one
        self._next_seq = 0
        self._seal_key: bytes | None = None  # datagram key the cached sealing AEAD is for
        self._seal_aead: ChaCha20Poly1305 | None = None
        # (datagram key, sender, epoch) -> AEAD; only authenticated entries go in, so
        # garbage from outside cannot push real fellows out.
        self._subkeys: OrderedDict[tuple[bytes, bytes, int], ChaCha20Poly1305] = OrderedDict()
        self._windows: OrderedDict[bytes, _Sender] = OrderedDict()

    @property
    def overhead_bytes(self) -> int:
        """Bytes a sealed datagram adds to its plaintext (header + tag)."""
        return _DATAGRAM_HEADER.size + _TAG_BYTES

    @property
    def node_id(self) -> bytes:
        return self._node_id

    @property
    def epoch(self) -> int:
        return self._epoch

    def seal(self, plaintext: bytes) -> bytes:
        key = self._keyring.primary
        if key.datagram_key is not self._seal_key:
            self._seal_aead = _datagram_subkey(key.datagram_key, self._node_id, self._epoch)
            self._seal_key = key.datagram_key
        assert self._seal_aead is not None
        seq = self._next_seq
        if seq > _U64_MAX:
            raise LocalProtocolError("sequence-exhausted", "start a new epoch")
        self._next_seq = seq + 1
        header = _DATAGRAM_HEADER.pack(
            _DATAGRAM_VERSION, key.key_id, self._node_id, self._epoch, seq
        )
        nonce = _NONCE_PAD + header[_SEQ_OFFSET:]
        return header + self._seal_aead.encrypt(nonce, plaintext, header)

    def open(self, packet: bytes) -> tuple[bytes, bytes]:
        """Return ``(sender node id, plaintext)`` or raise AuthenticationError (a datagram
        below its sender's proven epoch is ``stale-epoch``)."""
        opened = self.open_datagram(packet)
        if opened.stale:
            raise AuthenticationError(
                "stale-epoch", f"epoch {opened.epoch} older than this sender's proven one")
        return opened.sender, opened.plaintext

    def open_datagram(self, packet: bytes) -> OpenedDatagram:
        """Authenticate and de-duplicate ``packet``; raise AuthenticationError if it is
        not sealed under a key of ours, or a replay. One below its sender's proven epoch
        comes back ``stale`` and unrecorded (see the module docstring)."""
        header_bytes = _DATAGRAM_HEADER.size
        if len(packet) < header_bytes + _TAG_BYTES:
            raise AuthenticationError("malformed", f"datagram of {len(packet)} bytes")
        version, key_id, sender, epoch, seq = _DATAGRAM_HEADER.unpack_from(packet)
        if version != _DATAGRAM_VERSION:
            raise AuthenticationError("malformed", f"datagram version {version}")
        key = self._keyring.get(key_id)
        if key is None:
            raise AuthenticationError("unknown-key", f"key id {key_id.hex()}")
        cache_key = (key.datagram_key, sender, epoch)
        aead = self._subkeys.get(cache_key)
        fresh = aead is None
        if aead is None:
            aead = _datagram_subkey(key.datagram_key, sender, epoch)
        view = memoryview(packet)
        try:
            plaintext = aead.decrypt(
                _NONCE_PAD + packet[_SEQ_OFFSET:header_bytes],
                view[header_bytes:],
                view[:header_bytes],
            )
        except InvalidTag:
            raise AuthenticationError("bad-seal", "wrong key or tampered datagram") from None
        # Authenticated from here on.
        if fresh:
            self._subkeys[cache_key] = aead
            if len(self._subkeys) > self._max_subkeys:
                self._subkeys.popitem(last=False)
        else:
            self._subkeys.move_to_end(cache_key)
        state = self._windows.get(sender)
        if state is not None and epoch < state.proven:
            return OpenedDatagram(sender, epoch, seq, plaintext, True)
        self._accept(sender, epoch, seq, state)
        return OpenedDatagram(sender, epoch, seq, plaintext, False)

    def confirm(self, sender: bytes, epoch: int, incarnation: int,
                seq: int | None = None) -> bool:
        """``sender`` proved ``epoch`` with something it signed at ``incarnation``: make it
        the proven one if the proof is newer than the last (a replayed proof is not).
        ``seq``: record that datagram too (one that came back ``stale``). True if
        ``epoch`` is now the proven one."""
        state = self._sender(sender)
        if epoch == state.proven:
            state.proof = max(state.proof, incarnation)
            return True
        if incarnation <= state.proof:
            return False
        state.proven, state.proof = epoch, incarnation
        for old in [e for e in state.windows if e < epoch]:
            del state.windows[old]
        if seq is not None:
            self._accept(sender, epoch, seq)
        return True

    def proven_epoch(self, sender: bytes) -> int | None:
        state = self._windows.get(sender)
        return None if state is None or state.proven < 0 else state.proven

    def _sender(self, sender: bytes) -> _Sender:
        state = self._windows.get(sender)
        if state is None:
            state = self._windows[sender] = _Sender()
            if len(self._windows) > self._max_senders:
                # Forgetting a sender forgets its windows; the cap only bites in swarms
                # far larger than a room of machines.
                self._windows.popitem(last=False)
        self._windows.move_to_end(sender)
        return state

    def _accept(self, sender: bytes, epoch: int, seq: int, state: _Sender | None = None) -> None:
        if state is None:
            state = self._sender(sender)
        else:
            self._windows.move_to_end(sender)
        window = state.windows.get(epoch)
        if window is None:
            window = state.windows[epoch] = _ReplayWindow(epoch)
            while len(state.windows) > self._max_epochs:
                # forget the least recently used unproven epoch, never the proven one
                victim = next(e for e in state.windows if e != state.proven)
                del state.windows[victim]
        elif len(state.windows) > 1:
            state.windows.move_to_end(epoch)
        if seq > window.top:
            shift = seq - window.top
            if shift >= self._window:  # a jump past the whole window forgets it all
                window.bitmap = 1
            else:
                window.bitmap = ((window.bitmap << shift) | 1) & self._window_mask
            window.top = seq
            return
        age = window.top - seq
        if age >= self._window:
            raise AuthenticationError("replay", f"sequence {seq} is behind the window")
        bit = 1 << age
        if window.bitmap & bit:
            raise AuthenticationError("replay", f"sequence {seq} already seen")
        window.bitmap |= bit

