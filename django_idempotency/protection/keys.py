"""The keys and the cipher of encryption at rest: AES-256-GCM, one key id per key.

``IDEMPOTENCY["ENCRYPTION_KEYS"]`` lists 32-byte keys, newest first (``conf`` parses them). A
value is sealed with the newest and opened with whichever key sealed it, found by the key id
the sealed value carries. The format of a sealed value (bytes)::

    version (1 byte) | key id (4 bytes) | nonce (12 bytes) | ciphertext | tag (16 bytes)

The key id is the first 4 bytes of SHA-256 over a fixed label and the key: it names a key
(for the admin, the logs and the rotation) without revealing anything of it. The nonce is
random, so one key seals safely up to about 2**32 values (NIST SP 800-38D); rotate well before.

Every value is sealed with associated data: its first 17 bytes (version, key id, nonce) and a
context that names its place (the record's owner and key, the flow run's record, the outbox
message's event id): a sealed value copied to another row does not open there, so whoever can
write to the database cannot make one client replay another's response.

The version says which context the caller binds (:func:`open_sealed` takes one per version it
accepts):

* ``0x01``: the context of the value's place, as above; flow runs and outbox payloads are
  sealed so, and so were responses before 0x02;
* ``0x02``: a stored response's, whose context names the record's status too, so a status
  changed in the database does not open (``protection.core.record_contexts``).

The version byte is part of the associated data, so a 0x02 value whose byte is set to 0x01 (to be
opened with the context that does not name the status) does not open either.

``ENCRYPTION_MODE = "decrypt-only"`` keeps the keys for opening and seals nothing new:
:func:`keyring` opens, :func:`sealing_keyring` seals.

Only this module imports ``cryptography`` (the ``crypto`` extra), and only once a key is set.
A value that names no configured key is :class:`Undecryptable` without it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django_idempotency.conf import DECRYPT_ONLY, conf
from django_idempotency.exceptions import IdempotencyError
from django_idempotency.extras import missing_extra

__all__ = [
    "OVERHEAD",
    "V1",
    "V2",
    "Keyring",
    "Undecryptable",
    "key_id",
    "keyring",
    "sealed_key_id",
    "sealed_version",
    "sealing_keyring",
]

V1 = 1
"""The format whose context names the value's place (every value before 0x02)."""
V2 = 2
"""The format of a stored response whose context names its status too."""
VERSIONS = (V1, V2)
KEY_ID_BYTES = 4
NONCE_BYTES = 12
TAG_BYTES = 16
HEADER_BYTES = 1 + KEY_ID_BYTES + NONCE_BYTES
OVERHEAD = HEADER_BYTES + TAG_BYTES
"""How many bytes sealing adds to a value: 33."""

_KEY_ID_LABEL = b"django-idempotency encryption key id\x00"


class Undecryptable(IdempotencyError):
    """A sealed value that no configured key opens: its key was removed from
    ``ENCRYPTION_KEYS``, or the value was altered (or moved to another row)."""

    def __init__(self, message: str, *, key_id: str | None) -> None:
        super().__init__(message)
        self.key_id = key_id


def key_id(key: bytes) -> str:
    """The id of ``key``: 8 hex digits, one-way (they reveal nothing of the key)."""
    return hashlib.sha256(_KEY_ID_LABEL + key).digest()[:KEY_ID_BYTES].hex()


def sealed_version(sealed: bytes | memoryview | None) -> int | None:
    """The format version of ``sealed`` (:data:`V1`, :data:`V2`), or None when it is not a
    sealed value."""
    if sealed is None or len(sealed) < OVERHEAD or sealed[0] not in VERSIONS:
        return None
    return int(sealed[0])


def sealed_key_id(sealed: bytes | memoryview | None) -> str | None:
    """The id of the key that sealed ``sealed``, or None when it is not a sealed value."""
    if sealed_version(sealed) is None:
        return None
    assert sealed is not None
    return bytes(sealed[1 : 1 + KEY_ID_BYTES]).hex()


@dataclass
class Keyring:
    """The configured keys, ready to seal (with the newest) and open (with any)."""

    keys: tuple[bytes, ...]
    _ciphers: dict[bytes, Any] = field(default_factory=dict, repr=False)
    _newest: bytes = b""

    def __post_init__(self) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as error:
            raise missing_extra("crypto", __name__) from error
        for key in self.keys:
            raw_id = bytes.fromhex(key_id(key))
            if raw_id in self._ciphers:  # 1 in 4 billion; a clear error rather than a mix-up
                raise ValueError("Two ENCRYPTION_KEYS have the same key id: generate a new key.")
            self._ciphers[raw_id] = AESGCM(key)
        self._newest = bytes.fromhex(key_id(self.keys[0]))

    def __repr__(self) -> str:  # never the keys themselves
        return f"Keyring(key ids {', '.join(self.key_ids)})"

    @property
    def newest_id(self) -> str:
        """The id of the key new values are sealed with."""
        return self._newest.hex()

    @property
    def key_ids(self) -> list[str]:
        return [raw.hex() for raw in self._ciphers]

    def seal(self, plaintext: bytes, context: bytes, *, version: int = V1) -> bytes:
        """``plaintext`` sealed with the newest key, bound to ``context`` and ``version``
        (which says what ``context`` binds: see the module docstring)."""
        if version not in VERSIONS:
            raise ValueError(f"unknown sealed format version {version!r}")
        nonce = os.urandom(NONCE_BYTES)
        head = bytes([version]) + self._newest + nonce
        ciphertext: bytes = self._ciphers[self._newest].encrypt(nonce, plaintext, head + context)
        return head + ciphertext

    def open(self, sealed: bytes | memoryview, context: Contexts) -> bytes:
        """The plaintext of ``sealed``; raises :class:`Undecryptable`."""
        return open_sealed(self, sealed, context)


Contexts = bytes | Mapping[int, bytes]
"""The context a sealed value must be bound to, by version: a mapping of each version accepted
to its context, or bytes, the context of a :data:`V1` value (the only version accepted then)."""


def open_sealed(ring: Keyring | None, sealed: bytes | memoryview, context: Contexts) -> bytes:
    """The plaintext of ``sealed``, opened with ``ring`` (None: no keys are configured) and
    the context of its version in ``context``."""
    data = bytes(sealed)
    found = sealed_key_id(data)
    if found is None:
        raise Undecryptable("the value is not in the sealed format", key_id=None)
    contexts = {V1: context} if isinstance(context, bytes) else context
    bound = contexts.get(data[0])
    if bound is None:
        raise Undecryptable(
            f"sealed format version {data[0]} is not one this value can have", key_id=found
        )
    cipher = None if ring is None else ring._ciphers.get(data[1 : 1 + KEY_ID_BYTES])
    if cipher is None:
        raise Undecryptable(
            f"it was sealed with key {found}, which is not in ENCRYPTION_KEYS", key_id=found
        )
    from cryptography.exceptions import InvalidTag

    head = data[:HEADER_BYTES]
    try:
        plaintext: bytes = cipher.decrypt(data[5:HEADER_BYTES], data[HEADER_BYTES:], head + bound)
    except InvalidTag:
        raise Undecryptable(
            f"key {found} does not open it: it was altered, or moved from another row",
            key_id=found,
        ) from None
    return plaintext


_cache: tuple[Sequence[bytes], Keyring | None] = ((), None)


def keyring() -> Keyring | None:
    """The configured keys, or None when ``ENCRYPTION_KEYS`` is empty (nothing is encrypted).

    Built once per value of the setting (``override_settings`` makes a new one).
    """
    global _cache
    keys = conf.ENCRYPTION_KEYS
    source, ring = _cache
    if source is keys:
        return ring
    ring = Keyring(keys) if keys else None
    _cache = (keys, ring)
    return ring


def sealing_keyring() -> Keyring | None:
    """The keys new values are sealed with: :func:`keyring`, or None when ``ENCRYPTION_MODE``
    is ``"decrypt-only"`` (new values are stored in plaintext; sealed ones still open)."""
    ring = keyring()
    if ring is None or conf.ENCRYPTION_MODE == DECRYPT_ONLY:
        return None
    return ring
