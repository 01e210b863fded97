"""Owner scope: whose key space an idempotency key lives in.

Two owners may send the same key independently, and neither ever receives the other's response.
By default the owner is, in this order:

1. ``user:<pk>`` for an authenticated ``request.user`` (Django's, or DRF's when the decorator
   runs inside a DRF view, so token authentication counts);
2. ``auth:<HMAC of the Authorization header>`` for a request that carries credentials Django
   did not authenticate itself. The scheme is case-insensitive (``Basic`` and ``basic`` are one
   owner), and the HMAC is keyed with ``SECRET_KEY`` (:func:`~django.utils.crypto.salted_hmac`
   with the purpose :data:`AUTHORIZATION_SALT`), so that no word list can recover a password
   from a stored or shown owner. The header itself is never stored;
3. ``anonymous`` when there is neither. Every anonymous client shares this one scope.

``IDEMPOTENCY["OWNER"]`` may name a callable ``(request) -> str`` to use instead.

:func:`display_owner` is the form for logs and the admin: an ``auth:`` owner is cut to a short
prefix, enough to tell two clients apart and nothing more.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.crypto import salted_hmac
from django.utils.module_loading import import_string

from django_idempotency.conf import conf

ANONYMOUS = "anonymous"
MAX_OWNER_LENGTH = 255
AUTH_PREFIX = "auth:"
#: The purpose string of the HMAC that keys the ``auth:`` owner (``salted_hmac``'s salt).
AUTHORIZATION_SALT = "django_idempotency.http.owner.authorization"
#: How many hex digits of an ``auth:`` owner logs and the admin show.
DISPLAYED_DIGITS = 8
WHITESPACE = " \t"


def normalise_authorization(value: str) -> str:
    """``value`` with its scheme lowercased and the spaces around it collapsed.

    RFC 9110 section 11.1: the authentication scheme is case-insensitive, the credentials are
    not. ``Basic dXNlcg==`` and ``basic  dXNlcg==`` are then one owner.
    """
    scheme, _, credentials = value.strip(WHITESPACE).partition(" ")
    credentials = credentials.strip(WHITESPACE)
    return f"{scheme.lower()} {credentials}" if credentials else scheme.lower()


def authorization_owner(value: str) -> str:
    """The owner scope of an ``Authorization`` header value: a keyed HMAC, never the value."""
    normalised = normalise_authorization(value).encode("utf-8", "surrogatepass")
    digest = salted_hmac(AUTHORIZATION_SALT, normalised, algorithm="sha256").hexdigest()
    return AUTH_PREFIX + digest


def default_owner(request: Any) -> str:
    """The default owner scope of ``request`` (a Django ``HttpRequest`` or a DRF ``Request``)."""
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        return f"user:{user.pk}"
    authorization = request.headers.get("Authorization")
    if authorization and authorization.strip(WHITESPACE):
        return authorization_owner(authorization)
    return ANONYMOUS


def display_owner(owner: str) -> str:
    """``owner`` as logs and the admin show it: an ``auth:`` owner cut to a short prefix."""
    if owner.startswith(AUTH_PREFIX):
        return owner[: len(AUTH_PREFIX) + DISPLAYED_DIGITS] + "…"
    return owner


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
