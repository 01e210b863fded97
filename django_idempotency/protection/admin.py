"""The admin side of data protection: stored data shown decrypted, and the erasure action.

:class:`ProtectedRecordAdmin` is mixed into the record admin
(:class:`django_idempotency.admin.IdempotencyRecordAdmin`):

* the detail page shows the response **decrypted** to whoever may view records (the admin runs
  on the app server, which holds the keys), says whether the record is encrypted and with which
  key id, or when it was erased, and says so when no configured key opens it; no key is shown,
  only key ids;
* the list gets an *encryption* column (the key id, ``erased``, or nothing);
* the action *Erase the stored data of the selected records' owners* runs
  :func:`~django_idempotency.protection.core.erase_owner` for each owner, after a confirmation
  page, and needs the permission ``erase_idempotencyrecord``.

:class:`ProtectedFlowRunAdmin` shows a flow run's stored request and results decrypted, and
:class:`ProtectedOutboxAdmin` an outbox message's payload.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from django_idempotency.http.owner import display_owner
from django_idempotency.protection.core import (
    ERASED,
    Erased,
    Undecryptable,
    erase_owner,
    erased_at,
    flow_context,
    open_response,
    open_value,
    outbox_context,
    stored_key_id,
)

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]
else:  # generic only in django-stubs
    _ModelAdmin = admin.ModelAdmin

ERASE_PERMISSION = "erase"
"""``has_erase_permission``: the model's ``erase_<model>`` permission."""

ERASE_OWNERS_LIMIT = 100
"""The most owners one use of the erasure action erases (and its confirmation page lists)."""


@dataclass(frozen=True)
class Shown:
    """What the detail page shows of a record's stored response."""

    headers: dict[str, Any]
    body: bytes | None
    key_id: str | None
    """The id of the key it is encrypted with; None when it is stored in plaintext."""
    erased: str | None = None
    """When it was erased."""
    problem: str = ""
    """Why it cannot be shown (no configured key opens it)."""


def shown_response(obj: Any) -> Shown:
    """The record's response as the admin shows it, decrypted once per page."""
    cached: Shown | None = getattr(obj, "_idempotency_shown", None)
    if cached is not None:
        return cached
    headers = obj.response_headers if isinstance(obj.response_headers, dict) else {}
    body = None if obj.response_body is None else bytes(obj.response_body)
    key = stored_key_id(headers)
    try:
        opened, body = open_response(obj.owner, obj.key, headers, body, status=obj.response_status)
        shown = Shown(dict(opened), body, key)
    except Erased:
        shown = Shown({}, None, None, erased=erased_at(headers))
    except Undecryptable as error:
        shown = Shown({}, None, key, problem=str(error))
    obj._idempotency_shown = shown
    return shown


def describe_encryption(key_id: str | None, erased: str | None = None, problem: str = "") -> str:
    if erased is not None:
        return str(_("Erased at %(when)s") % {"when": erased})
    if key_id is None:
        return str(_("Not encrypted"))
    text = str(_("Encrypted with key %(key_id)s") % {"key_id": key_id})
    if problem:
        text += str(_("; it cannot be shown: %(problem)s") % {"problem": problem})
    return text


class ProtectedRecordAdmin(_ModelAdmin):
    """The record admin's encryption display and erasure action (see the module docstring)."""

    @admin.display(description=_("encryption"))
    def encryption(self, obj: Any) -> str:
        """The detail page's line: plaintext, encrypted with which key, or erased."""
        shown = shown_response(obj)
        return describe_encryption(shown.key_id, shown.erased, shown.problem)

    @admin.display(description=_("encryption"))
    def encryption_column(self, obj: Any) -> str:
        """The list's column, read from the stored headers' marker alone (nothing decrypted)."""
        headers = obj.response_headers if isinstance(obj.response_headers, dict) else {}
        if ERASED in headers:
            return str(_("erased"))
        return stored_key_id(headers) or "-"

    def has_erase_permission(self, request: HttpRequest) -> bool:
        opts = self.model._meta
        return bool(request.user.has_perm(f"{opts.app_label}.erase_{opts.model_name}"))

    @admin.action(
        description=_("Erase the stored data of the selected records' owners"),
        permissions=[ERASE_PERMISSION],
    )
    def erase_owners(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        if not self.has_erase_permission(request):
            raise PermissionDenied
        owners = list(
            queryset.order_by("owner")
            .values_list("owner", flat=True)
            .distinct()[: ERASE_OWNERS_LIMIT + 1]
        )
        if len(owners) > ERASE_OWNERS_LIMIT:
            self.message_user(
                request,
                _("Select the records of at most %(limit)d owners at a time.")
                % {"limit": ERASE_OWNERS_LIMIT},
                messages.ERROR,
            )
            return None
        if request.POST.get("post") != "yes":
            return self._confirm_erasure(request, queryset, owners)
        erased = unfinished = 0
        for owner in owners:
            result = erase_owner(owner, using=queryset.db)
            erased += result.records
            unfinished += result.unfinished
        self.message_user(
            request,
            ngettext(
                "Erased %(count)d record of %(owners)d owner(s); it stays as a tombstone until "
                "it expires, and a retry of its key is answered 410.",
                "Erased %(count)d records of %(owners)d owner(s); they stay as tombstones until "
                "they expire, and a retry of their keys is answered 410.",
                erased,
            )
            % {"count": erased, "owners": len(owners)},
            messages.SUCCESS,
        )
        if unfinished:
            self.message_user(
                request,
                ngettext(
                    "%(count)d record still in progress was left as it is: erase again once it "
                    "has ended.",
                    "%(count)d records still in progress were left as they are: erase again "
                    "once they have ended.",
                    unfinished,
                )
                % {"count": unfinished},
                messages.WARNING,
            )
        return None

    def _confirm_erasure(
        self, request: HttpRequest, queryset: QuerySet[Any], owners: list[str]
    ) -> HttpResponse:
        opts = self.model._meta
        context = {
            **self.admin_site.each_context(request),
            "title": _("Erase the stored data of these owners?"),
            "opts": opts,
            "owners": [display_owner(owner) for owner in owners],
            "queryset": queryset,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "index": request.POST.get("index", "0"),
            "media": self.media,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "django_idempotency/admin/erase_confirmation.html", context
        )


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def _shown_value(value: Any, context: bytes) -> SafeString:
    """A stored JSON value, opened with ``context`` and shown as JSON under a note of its key;
    the reason alone when it cannot be opened."""
    key = stored_key_id(value)
    try:
        opened = open_value(value, context)
    except Undecryptable as error:
        return format_html("<p>{}</p>", describe_encryption(key, problem=str(error)))
    note = "" if key is None else describe_encryption(key)
    return format_html(
        '<p class="help">{}</p><pre style="white-space: pre-wrap; margin: 0;">{}</pre>',
        note,
        pretty(opened),
    )


class ProtectedFlowRunAdmin(_ModelAdmin):
    """A flow run's stored request and results, shown decrypted."""

    @admin.display(description=_("request"))
    def stored_request(self, obj: Any) -> SafeString:
        return self._shown(obj, obj.request, "request")

    @admin.display(description=_("phase results"))
    def stored_results(self, obj: Any) -> SafeString:
        return self._shown(obj, obj.results, "results")

    @staticmethod
    def _shown(obj: Any, value: Any, field: str) -> SafeString:
        return _shown_value(value, flow_context(obj.record_id, field))


class ProtectedOutboxAdmin(_ModelAdmin):
    """An outbox message's payload, shown decrypted (``OUTBOX_ENCRYPT``)."""

    @admin.display(description=_("payload"))
    def stored_payload(self, obj: Any) -> SafeString:
        return _shown_value(obj.payload, outbox_context(obj.event_id))
