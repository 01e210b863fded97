"""Owner scope: whose key space an idempotency key lives in.

Two owners may send the same key independently, and neither ever receives the other's response.
By default the owner is, in this order:

1. ``user:<pk>`` for an authenticated ``request.user`` (Django's, or DRF's when the decorator
   runs inside a DRF view, so token authentication counts);
2. ``auth:<sha256 of the Authorization header>`` for a request that carries credentials Django
   did not authenticate itself (the header is never stored, only its hash);
3. ``anonymous`` when there is neither. Every anonymous client shares this one scope.

``IDEMPOTENCY["OWNER"]`` may name a callable ``(request) -> str`` to use instead.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_idempotency.conf import conf

ANONYMOUS = "anonymous"
MAX_OWNER_LENGTH = 255


def default_owner(request: Any) -> str:
    """The default owner scope of ``request`` (a Django ``HttpRequest`` or a DRF ``Request``)."""
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        return f"user:{user.pk}"
    authorization = request.headers.get("Authorization")
    if authorization:
        return "auth:" + hashlib.sha256(authorization.encode("utf-8", "surrogatepass")).hexdigest()
    return ANONYMOUS


@lru_cache(maxsize=16)
def _load(path: str) -> Any:
    try:
        return import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"IDEMPOTENCY['OWNER'] = {path!r} cannot be imported: {exc}. Point it at a callable "
            "that takes the request and returns a string."
        ) from exc


def resolve_owner(request: Any) -> str:
    """The owner scope of ``request``: ``IDEMPOTENCY["OWNER"]``, else :func:`default_owner`."""
    path = conf.OWNER
    owner = _load(path)(request) if path else default_owner(request)
    if not isinstance(owner, str) or not 0 < len(owner) <= MAX_OWNER_LENGTH:
        raise ImproperlyConfigured(
            f"The owner callable {path or 'default_owner'!r} returned {owner!r}; it must return "
            f"a non-empty string of at most {MAX_OWNER_LENGTH} characters (hash longer values)."
        )
    return owner
