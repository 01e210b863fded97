"""Owner scope: whose key space an idempotency key lives in.

Two owners may send the same key independently, and neither ever receives the other's response.
:func:`resolve_owner` is the one place that turns "what this request authenticated as" into an
owner: the decorator, the middleware (its DRF path too), :class:`~django_idempotency.http.drf.
IdempotentMixin` and every other adapter call it. By default (:func:`default_owner`) the owner
is, in this order:

1. :func:`principal_owner` of an authenticated ``request.user`` (Django's, or DRF's when the
   request is a DRF ``Request``, so token and basic authentication count): ``user:<pk>`` for an
   instance of ``AUTH_USER_MODEL``, ``principal:<app_label>.<model_name>:<pk>`` for an instance
   of another model (an API client that a DRF authenticator returns), and
   ``principal:<module>.<class>:<pk>`` for an object with a ``pk`` that is no model;
2. ``auth:<HMAC of the Authorization header>`` for a request that carries credentials nothing
   authenticated. The scheme is case-insensitive (``Basic`` and ``basic`` are one owner), the
   credentials are not, and the HMAC is keyed with ``SECRET_KEY``
   (:func:`~django.utils.crypto.salted_hmac` with the purpose :data:`AUTHORIZATION_SALT`), so
   that no word list can recover a password from a stored or shown owner. The header itself is
   never stored;
3. ``anonymous`` when there is neither. Every anonymous client shares this one scope.

An authenticated ``request.user`` that names no one (no ``pk``) and no ``Authorization`` header
is a configuration mistake: :class:`~django.core.exceptions.ImproperlyConfigured`, never the
shared ``anonymous`` scope.

``IDEMPOTENCY["OWNER"]`` may name a callable ``(request) -> str`` to use instead.

:func:`display_owner` is the form for logs and the admin: an ``auth:`` owner is cut to a short
prefix, enough to tell two clients apart and nothing more.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.crypto import salted_hmac
from django.utils.module_loading import import_string

from django_idempotency.conf import conf

ANONYMOUS = "anonymous"
MAX_OWNER_LENGTH = 255
AUTH_PREFIX = "auth:"
USER_PREFIX = "user:"
PRINCIPAL_PREFIX = "principal:"
#: The purpose string of the HMAC that keys the ``auth:`` owner (``salted_hmac``'s salt).
AUTHORIZATION_SALT = "django_idempotency.http.owner.authorization"
#: The purpose string of the HMAC that keys the owner of a principal given as a string.
PRINCIPAL_SALT = "django_idempotency.http.owner.principal"
#: How many hex digits of an ``auth:`` owner logs and the admin show.
DISPLAYED_DIGITS = 8
WHITESPACE = " \t"
#: The scheme, one run of spaces and tabs (RFC 9110: 1*SP; tabs are accepted as DRF and
#: gunicorn do), and the credentials.
_SCHEME = re.compile(r"([^ \t]*)[ \t]*(.*)", re.DOTALL)


def normalise_authorization(value: str) -> str:
    """``value`` with its scheme lowercased and the spaces and tabs around it collapsed.

    RFC 9110 section 11.1: the authentication scheme is case-insensitive, the credentials are
    not. ``Basic dXNlcg==``, ``basic  dXNlcg==`` and ``Basic<TAB>dXNlcg==`` are then one owner,
    and ``Bearer<TAB>abc`` and ``Bearer<TAB>ABC`` are two.
    """
    match = _SCHEME.fullmatch(value.strip(WHITESPACE))
    assert match is not None  # the pattern matches every string
    scheme, credentials = match.group(1), match.group(2)
    return f"{scheme.lower()} {credentials}" if credentials else scheme.lower()


def authorization_owner(value: str) -> str:
    """The owner scope of an ``Authorization`` header value: a keyed HMAC, never the value."""
    normalised = normalise_authorization(value).encode("utf-8", "surrogatepass")
    digest = salted_hmac(AUTHORIZATION_SALT, normalised, algorithm="sha256").hexdigest()
    return AUTH_PREFIX + digest


def principal_owner(principal: Any) -> str | None:
    """The owner scope of what a request authenticated as, or None when it names no one.

    ``principal`` is ``request.user`` (Django's or DRF's), or any other object an
    authentication layer returns, such as django-ninja's ``request.auth``:

    * None, a bool, or an object whose ``is_authenticated`` is false (``AnonymousUser``): None;
    * an instance of ``AUTH_USER_MODEL``: ``user:<pk>``, the owner of every release so far;
    * an instance of any other model: ``principal:<app_label>.<model_name>:<pk>``, so that an
      API client with pk 1 and user 1 are two owners;
    * a string or bytes (a token an authentication callable returned as is): ``auth:`` and a
      keyed HMAC of it, never the value;
    * another object with a ``pk``: ``principal:<module>.<class name>:<pk>``;
    * anything else (no ``pk``, a model instance not yet saved): None.

    An owner longer than the column (255 characters), or with a character that is not printable
    (NUL, a lone surrogate, a control character, which no database column keeps as sent), is
    replaced by ``principal:`` and its SHA-256. It takes the principal only, no request, so
    that code without a request (the flow completer) derives the same owner from the same
    principal.
    """
    if principal is None or isinstance(principal, bool):
        return None
    if isinstance(principal, (str, bytes)):
        raw = (
            principal.encode("utf-8", "surrogatepass") if isinstance(principal, str) else principal
        )
        if not raw:
            return None
        digest = salted_hmac(PRINCIPAL_SALT, raw, algorithm="sha256").hexdigest()
        return AUTH_PREFIX + digest
    if not getattr(principal, "is_authenticated", True):
        return None
    pk = getattr(principal, "pk", None)
    if pk is None:
        return None
    user_model = _user_model()
    if user_model is not None and isinstance(principal, user_model):
        return f"{USER_PREFIX}{pk}"  # a proxy or a subclass of it too: the same users
    meta = getattr(principal, "_meta", None)
    label = getattr(meta, "label_lower", None)
    if not isinstance(label, str):
        kind = principal.__class__  # through a SimpleLazyObject, the wrapped object's class
        label = f"{kind.__module__}.{kind.__qualname__}"
    owner = f"{PRINCIPAL_PREFIX}{label}:{pk}"
    if len(owner) > MAX_OWNER_LENGTH or not owner.isprintable():  # NUL, lone surrogates
        owner = (
            PRINCIPAL_PREFIX + hashlib.sha256(owner.encode("utf-8", "surrogatepass")).hexdigest()
        )
    return owner


def _user_model() -> type | None:
    """``AUTH_USER_MODEL``, or None in a project without it installed."""
    try:
        return apps.get_model(settings.AUTH_USER_MODEL, require_ready=False)
    except (LookupError, ValueError):
        return None


def default_owner(request: Any) -> str:
    """The default owner scope of ``request`` (a Django ``HttpRequest`` or a DRF ``Request``)."""
    user = getattr(request, "user", None)
    owner = principal_owner(user)
    if owner is not None:
        return owner
    authorization = request.headers.get("Authorization")
    if authorization and authorization.strip(WHITESPACE):
        return authorization_owner(authorization)
    if user is not None and getattr(user, "is_authenticated", False):
        raise ImproperlyConfigured(
            f"request.user ({type(user).__qualname__}) is authenticated but names no one (it "
            "has no pk), and the request has no Authorization header: its keys would share the "
            "anonymous scope. Give the principal a pk, or set IDEMPOTENCY['OWNER'] to a callable "
            "that returns its owner."
        )
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
