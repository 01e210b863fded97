"""System checks of data protection (``ENCRYPTION_KEYS``, ``OUTBOX_ENCRYPT``,
``ENCRYPTION_MODE``).

A malformed key, or one shorter than AES-256-GCM needs, is ``E002`` (``conf`` parses the keys,
and the message names the key's position, never the key). Here:

* ``E050``: keys are set but ``cryptography`` (the ``crypto`` extra) is not installed;
* ``E051``: ``OUTBOX_ENCRYPT`` is on but no key is set (in the ``"encrypt"`` mode);
* ``E052``: ``ENCRYPTION_MODE`` is ``"decrypt-only"`` but no key is set, so nothing sealed opens;
* ``W053``: ``OUTBOX_ENCRYPT`` is on in the ``"decrypt-only"`` mode, which wins: payloads are
  written in plaintext. A warning, not an error: pausing encryption during an incident takes one
  setting, and a deploy is not stopped by the second.

A misspelt ``ENCRYPTION_MODE`` is ``E002`` (``conf`` parses it).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured

from django_idempotency.conf import DECRYPT_ONLY, ENCRYPTION_KEYS_ENV, SETTING_NAME, conf

MISSING_CRYPTOGRAPHY = "django_idempotency.E050"
ENCRYPT_WITHOUT_KEYS = "django_idempotency.E051"
DECRYPT_ONLY_WITHOUT_KEYS = "django_idempotency.E052"
OUTBOX_ENCRYPT_IGNORED = "django_idempotency.W053"


@register(Tags.compatibility)
def check_encryption(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    try:
        keys = conf.ENCRYPTION_KEYS
        encrypt_outbox = conf.OUTBOX_ENCRYPT
        decrypt_only = conf.ENCRYPTION_MODE == DECRYPT_ONLY
    except ImproperlyConfigured:
        return []  # E002, from the settings check
    messages: list[CheckMessage] = []
    if keys and importlib.util.find_spec("cryptography") is None:
        messages.append(
            Error(
                f"{SETTING_NAME}['ENCRYPTION_KEYS'] (or {ENCRYPTION_KEYS_ENV}) holds keys, but "
                "the cryptography package is not installed.",
                hint="pip install 'django-idempotency[crypto]'",
                id=MISSING_CRYPTOGRAPHY,
            )
        )
    if decrypt_only and not keys:
        messages.append(
            Error(
                f"{SETTING_NAME}['ENCRYPTION_MODE'] is 'decrypt-only', but no encryption key is "
                "set: what is stored encrypted cannot be opened (its retries are answered 422).",
                hint=f"Keep the keys in {SETTING_NAME}['ENCRYPTION_KEYS'] (or "
                f"{ENCRYPTION_KEYS_ENV}) until idempotency_rotate_keys --decrypt says Done; "
                "then remove ENCRYPTION_MODE together with the keys.",
                id=DECRYPT_ONLY_WITHOUT_KEYS,
            )
        )
    if encrypt_outbox and decrypt_only:
        messages.append(
            Warning(
                f"{SETTING_NAME}['OUTBOX_ENCRYPT'] is True, but ENCRYPTION_MODE is "
                "'decrypt-only', which wins: new outbox payloads are written in plaintext.",
                hint="Remove OUTBOX_ENCRYPT while encryption is off, or set ENCRYPTION_MODE "
                "back to 'encrypt' to encrypt again.",
                id=OUTBOX_ENCRYPT_IGNORED,
            )
        )
    elif encrypt_outbox and not keys:
        messages.append(
            Error(
                f"{SETTING_NAME}['OUTBOX_ENCRYPT'] is True, but no encryption key is set.",
                hint=f"Set {SETTING_NAME}['ENCRYPTION_KEYS'] (or the environment variable "
                f"{ENCRYPTION_KEYS_ENV}), or remove OUTBOX_ENCRYPT.",
                id=ENCRYPT_WITHOUT_KEYS,
            )
        )
    return messages
