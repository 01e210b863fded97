"""System checks of data protection (``ENCRYPTION_KEYS``, ``OUTBOX_ENCRYPT``).

A malformed key, or one shorter than AES-256-GCM needs, is ``E002`` (``conf`` parses the keys,
and the message names the key's position, never the key). Here:

* ``E050``: keys are set but ``cryptography`` (the ``crypto`` extra) is not installed;
* ``E051``: ``OUTBOX_ENCRYPT`` is on but no key is set.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, register
from django.core.exceptions import ImproperlyConfigured

from django_idempotency.conf import ENCRYPTION_KEYS_ENV, SETTING_NAME, conf

MISSING_CRYPTOGRAPHY = "django_idempotency.E050"
ENCRYPT_WITHOUT_KEYS = "django_idempotency.E051"


@register(Tags.compatibility)
def check_encryption(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    try:
        keys = conf.ENCRYPTION_KEYS
        encrypt_outbox = conf.OUTBOX_ENCRYPT
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
    if encrypt_outbox and not keys:
        messages.append(
            Error(
                f"{SETTING_NAME}['OUTBOX_ENCRYPT'] is True, but no encryption key is set.",
                hint=f"Set {SETTING_NAME}['ENCRYPTION_KEYS'] (or the environment variable "
                f"{ENCRYPTION_KEYS_ENV}), or remove OUTBOX_ENCRYPT.",
                id=ENCRYPT_WITHOUT_KEYS,
            )
        )
    return messages
