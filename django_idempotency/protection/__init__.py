"""Data protection: encryption at rest, key rotation and erasure by owner (docs/security.md).

Read top down, each layer calls only the ones below it:

* adapters: :mod:`.checks` (system checks), :mod:`.admin` (the admin's erasure action and
  display), and the commands ``idempotency_rotate_keys`` and ``idempotency_erase``;
* :mod:`.core`: what is sealed, how a stored value is opened, the rotation, the decryption
  (``ENCRYPTION_MODE = "decrypt-only"``) and the erasure;
* :mod:`.keys`: the keys and the cipher (AES-256-GCM, the ``crypto`` extra);
* :mod:`.store`: the batches and compare-and-swap writes.

``decrypt_stored``, ``erase_owner`` and ``rotate_keys`` are importable from here, lazily.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = ["decrypt_stored", "erase_owner", "rotate_keys"]

if TYPE_CHECKING:
    from django_idempotency.protection.core import decrypt_stored, erase_owner, rotate_keys


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module("django_idempotency.protection.core"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
