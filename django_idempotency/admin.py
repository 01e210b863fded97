"""Read-only admin pages for idempotency records, processed events, event deliveries and the
outbox.

These tables are logs: they can hold millions of rows, and nobody should edit them by hand. Every
page is therefore read-only (rows can be deleted), and each list page stays cheap on a large table:

* the total is never counted twice (``show_full_result_count = False``), and the page count comes
  from :class:`EstimatedCountPaginator`, which counts at most :data:`EXACT_COUNT_LIMIT` rows;
* the default ordering, and every sortable column, is backed by an index;
* the filter choices for free-text columns (path, consumer, topic) come from a bounded sample of
  the newest rows, never from a ``DISTINCT`` over the whole table;
* the date hierarchy comes from one indexed ``MIN``/``MAX`` query
  (:mod:`django_idempotency.templatetags.idempotency_admin`), not a ``DISTINCT`` over the table;
* search is an exact match, never a ``LIKE '%...%'`` scan;
* the list never loads stored response bodies, and there are no related-object queries (N+1).

Why this module is long: five ModelAdmins (records, processed events, deliveries, outbox, flow
runs) share their filters, actions and display helpers; each is short.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Model, Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.loader import render_to_string
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.http import parse_header_parameters
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from django_idempotency.http.owner import display_owner
from django_idempotency.managers import PurgeResult
from django_idempotency.models import (
    EventDelivery,
    FlowRun,
    IdempotencyRecord,
    OutboxEntry,
    ProcessedEvent,
)
from django_idempotency.pretty import pretty_json
from django_idempotency.protection.admin import (
    ProtectedFlowRunAdmin,
    ProtectedOutboxAdmin,
    ProtectedRecordAdmin,
    shown_response,
)

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]
    _Paginator = Paginator[Any]
else:  # generic only in django-stubs
    _ModelAdmin = admin.ModelAdmin
    _Paginator = Paginator

EXACT_COUNT_LIMIT = 10_000
"""Above this many matching rows a list page shows an estimated total instead of counting."""

RECENT_SAMPLE = 5_000
"""How many of the newest rows the path, consumer and topic filters draw their choices from."""

MAX_FILTER_CHOICES = 30
"""The most choices a sampled filter lists."""

PREVIEW_CHARS = 20_000
"""The longest text or JSON body the detail page shows before truncating."""

PREVIEW_DEPTH = 20
"""How deep a JSON body is shown; arrays and objects nested deeper are shown as ``[…]``."""

BINARY_PREVIEW_BYTES = 512
"""How many bytes of a binary body the detail page shows as a hex dump."""

ADMIN_PURGE_SECONDS = 10
"""The purge button stops after this many seconds, between batches; the scheduled purge goes on."""

DELETE_LIST_LIMIT = 100
"""The most rows the delete confirmation page names one by one."""


# --- Rendering a stored response --------------------------------------------------------------


@dataclass(frozen=True)
class BodyPreview:
    """A readable, bounded view of a stored response body."""

    kind: str
    """``"none"``, ``"empty"``, ``"json"``, ``"text"`` or ``"binary"``."""
    text: str
    """What to show, already truncated; plain text, to be HTML-escaped by the template."""
    size: int
    """The body's length in bytes."""
    truncated: bool
    """True when :attr:`text` is only the start of the body."""


def _hexdump(data: bytes) -> str:
    lines = []
    for offset in range(0, len(data), 16):
        chunk = data[offset : offset + 16]
        hex_part = " ".join(f"{byte:02x}" for byte in chunk)
        text_part = "".join(chr(byte) if 32 <= byte < 127 else "." for byte in chunk)
        lines.append(f"{offset:08x}  {hex_part:<47}  {text_part}")
    return "\n".join(lines)


def _charset(content_type: str) -> str:
    charset = parse_header_parameters(content_type)[1].get("charset", "utf-8") or "utf-8"
    try:
        "".encode(charset)
    except LookupError:
        return "utf-8"
    return charset


_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _is_printable(text: str) -> bool:
    return _CONTROL_CHARACTERS.search(text) is None


def _truncate(text: str) -> tuple[str, bool]:
    if len(text) <= PREVIEW_CHARS:
        return text, False
    return text[:PREVIEW_CHARS], True


def _pretty_json(text: str) -> tuple[str, bool] | None:
    """The start of ``text`` pretty-printed (at most :data:`PREVIEW_CHARS` characters, deeper
    than :data:`PREVIEW_DEPTH` elided) and whether it was cut, or None when it is not JSON (or
    holds a lone surrogate, which no page can encode), and is then shown as text.

    Pretty-printing the whole document before cutting it cost 17 s and 912 MB for a 1 MB
    body of deeply nested arrays; :func:`~django_idempotency.pretty.pretty_json` writes only
    what is shown.
    """
    return pretty_json(text, PREVIEW_CHARS, PREVIEW_DEPTH)


def preview_body(body: bytes | memoryview | None, content_type: str = "") -> BodyPreview:
    """Describe a stored body for a human: JSON pretty-printed, text as is, binary as a hex dump.

    Long bodies are cut to :data:`PREVIEW_CHARS` characters (:data:`BINARY_PREVIEW_BYTES` bytes
    for binary data), and the preview says so. The result is plain text; the template escapes it.
    """
    if body is None:
        return BodyPreview("none", "", 0, False)
    data = bytes(body)
    if not data:
        return BodyPreview("empty", "", 0, False)
    media_type = parse_header_parameters(content_type)[0] if content_type else ""
    try:
        text = data.decode(_charset(content_type))
    except UnicodeDecodeError:
        text = None
    if text is not None and _is_printable(text):
        stripped = text.lstrip()
        if "json" in media_type or stripped[:1] in ("{", "["):
            pretty = _pretty_json(text)
            if pretty is not None:
                shown, truncated = pretty
                return BodyPreview("json", shown, len(data), truncated)
        shown, truncated = _truncate(text)
        return BodyPreview("text", shown, len(data), truncated)
    return BodyPreview(
        "binary",
        _hexdump(data[:BINARY_PREVIEW_BYTES]),
        len(data),
        len(data) > BINARY_PREVIEW_BYTES,
    )


def header_pairs(headers: object) -> list[tuple[str, str]]:
    """Stored response headers as (name, value) pairs, whether stored as a dict or a list."""
    if isinstance(headers, dict):
        return [(str(name), str(value)) for name, value in headers.items()]
    if isinstance(headers, list):
        return [
            (str(item[0]), str(item[1]))
            for item in headers
            if isinstance(item, (list, tuple)) and len(item) == 2
        ]
    return []


def _content_type(headers: object) -> str:
    for name, value in header_pairs(headers):
        if name.lower() == "content-type":
            return value
    return ""


# --- Fast list pages --------------------------------------------------------------------------


class EstimatedCountPaginator(_Paginator):
    """A paginator that never counts more than :data:`EXACT_COUNT_LIMIT` rows.

    Up to the limit the count is exact. Beyond it, PostgreSQL and MySQL/MariaDB give the
    planner's row estimate for the same query (what ``EXPLAIN`` prints), and SQLite, whose
    ``COUNT(*)`` is cheap, counts. The admin then says, for example, "1004312 idempotency records"
    where the real figure may differ by a few percent, and the page links stay usable.
    """

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return len(queryset)
        capped = queryset.order_by()[: EXACT_COUNT_LIMIT + 1].count()
        if capped <= EXACT_COUNT_LIMIT:
            return capped
        estimate = _planner_estimate(queryset)
        if estimate is None:
            return queryset.count()
        return max(estimate, capped)


def _planner_estimate(queryset: QuerySet[Any]) -> int | None:
    connection = connections[queryset.db]
    sql, params = queryset.order_by().values("pk").query.sql_with_params()
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
            if isinstance(plan, str):
                plan = json.loads(plan)
            return int(plan[0]["Plan"]["Plan Rows"])
        if connection.vendor == "mysql":
            cursor.execute(f"EXPLAIN {sql}", params)
            columns = [column[0] for column in cursor.description]
            row = cursor.fetchone()
            if row is None or "rows" not in columns:
                return None
            rows = row[columns.index("rows")]
            return int(rows) if rows is not None else None
    return None


class RecentValuesFilter(admin.SimpleListFilter):
    """Filter choices drawn from the newest :data:`RECENT_SAMPLE` rows, not the whole table.

    A ``DISTINCT`` over a free-text column of a million rows is a full scan on every page view;
    a sample of the newest rows, read through the index on :attr:`newest_by`, is not. A value
    missing from the sample can still be filtered on through the query string
    (``?path=/api/orders/``).
    """

    field: ClassVar[str]
    newest_by: ClassVar[str]

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        sample = model_admin.model._default_manager.order_by(f"-{self.newest_by}").values_list(
            self.field, flat=True
        )[:RECENT_SAMPLE]
        values = sorted({value for value in sample if value})[:MAX_FILTER_CHOICES]
        current = self.value()
        if current and current not in values:
            values.append(current)
        return [(value, value) for value in values]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(**{self.field: value}) if value else queryset


def recent_values_filter(field: str, newest_by: str, title: str) -> type[RecentValuesFilter]:
    """A :class:`RecentValuesFilter` for ``field``, sampled by the indexed ``newest_by``."""
    return type(
        f"Recent{field.title().replace('_', '')}Filter",
        (RecentValuesFilter,),
        {"field": field, "newest_by": newest_by, "title": title, "parameter_name": field},
    )


class ExpiredFilter(admin.SimpleListFilter):
    """Rows the purge may delete now (past ``expires_at``), or still live."""

    title = _("expired")
    parameter_name = "expired"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        return [("yes", str(_("Expired"))), ("no", str(_("Live")))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        # The purge's own definition: by the database clock, live leases are not expired.
        if self.value() == "yes":
            return queryset.filter(queryset.expired_condition())  # type: ignore[attr-defined]
        if self.value() == "no":
            return queryset.exclude(queryset.expired_condition())  # type: ignore[attr-defined]
        return queryset


class StatusClassFilter(admin.SimpleListFilter):
    """The stored response's status class: 2xx, 3xx, 4xx, 5xx, or none stored yet."""

    title = _("status class")
    parameter_name = "status_class"
    CLASSES: ClassVar[dict[str, tuple[int, int]]] = {
        "2xx": (200, 300),
        "3xx": (300, 400),
        "4xx": (400, 500),
        "5xx": (500, 600),
    }

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        return [(name, name) for name in self.CLASSES] + [("none", str(_("No response yet")))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "none":
            return queryset.filter(response_status__isnull=True)
        if value in self.CLASSES:
            low, high = self.CLASSES[value]
            return queryset.filter(response_status__gte=low, response_status__lt=high)
        return queryset


class ParkedFilter(admin.SimpleListFilter):
    """Poison messages that were parked after too many deliveries, or not."""

    title = _("parked")
    parameter_name = "parked"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        return [("yes", str(_("Parked"))), ("no", str(_("Not parked")))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(parked_at__isnull=False)
        if self.value() == "no":
            return queryset.filter(parked_at__isnull=True)
        return queryset


class _ListWithoutBodies(ChangeList):
    """The record list never loads stored bodies (up to MAX_RESPONSE_BYTES each). It loads the
    headers, a few hundred bytes, for the encryption column (a sealed record's are its marker)."""

    def get_queryset(
        self, request: HttpRequest, exclude_parameters: list[str | None] | None = None
    ) -> QuerySet[Any]:
        return (
            super()
            .get_queryset(request, exclude_parameters)
            .defer("response_body", "fingerprint", "token")
        )


class ReadOnlyLogAdmin(_ModelAdmin):
    """Shared behaviour: read-only rows, deletable, cheap on large tables."""

    paginator = EstimatedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 100

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        names = [field.name for field in self.model._meta.concrete_fields]
        return names + [name for name in self.readonly_fields if name not in names]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """Match the whole term exactly (case-sensitive, so an index can serve it), never LIKE."""
        term = search_term.strip()
        fields = self.get_search_fields(request)
        if not term or not fields:
            return queryset, False
        condition = Q()
        for name in fields:
            condition |= Q(**{name: term})
        return queryset.filter(condition), False

    def get_deleted_objects(
        self, objs: Sequence[Any] | QuerySet[Any], request: HttpRequest
    ) -> tuple[list[str], dict[str, int], set[str], list[str]]:
        """Name at most :data:`DELETE_LIST_LIMIT` rows on the confirmation page.

        Django's default lists every row (and walks relations, which these tables have none
        of); for "select all 1,000,000" that page would never render.
        """
        opts = self.model._meta
        if isinstance(objs, QuerySet):
            total = objs.count()
            named = [str(obj) for obj in objs[:DELETE_LIST_LIMIT]]
        else:
            total = len(objs)
            named = [str(obj) for obj in objs[:DELETE_LIST_LIMIT]]
        if total > len(named):
            named.append(str(_("… and %(count)d more") % {"count": total - len(named)}))
        perms_needed = set() if self.has_delete_permission(request) else {str(opts.verbose_name)}
        return named, {str(opts.verbose_name_plural): total}, perms_needed, []

    @admin.display(boolean=True, description=_("expired"), ordering="expires_at")
    def expired(self, obj: Any) -> bool:
        return bool(obj.expires_at <= timezone.now())


# --- Purging expired rows ---------------------------------------------------------------------


class PurgeExpiredMixin(ReadOnlyLogAdmin):
    """A "purge expired records now" action, and the same as a button above the list."""

    change_list_template = "django_idempotency/admin/change_list.html"
    actions = ["purge_expired"]

    def get_ordering(self, request: HttpRequest) -> list[str] | tuple[str, ...]:
        """With the *expired* filter, the most recently expired first, through the
        ``expires_at`` index. Expired rows are the oldest: newest first by creation (or id),
        a page walked the index past every live row to find them (0.25 s at a million rows,
        growing with the table; bench/growth.py)."""
        if request.GET.get(ExpiredFilter.parameter_name) == "yes":
            return ("-expires_at",)
        return super().get_ordering(request)

    @admin.action(
        description=_("Purge all expired rows now (not only the selected ones)"),
        permissions=["delete"],
    )
    def purge_expired(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._purge_and_report(request)

    def _purge_and_report(self, request: HttpRequest) -> None:
        """Run the manager's batched ``delete_expired`` for at most ADMIN_PURGE_SECONDS."""
        if not self.has_delete_permission(request):
            raise PermissionDenied
        result: PurgeResult = self.model._default_manager.delete_expired(
            max_seconds=ADMIN_PURGE_SECONDS
        )
        opts = self.model._meta
        names = {"name": opts.verbose_name, "plural": opts.verbose_name_plural}
        self.message_user(
            request,
            ngettext(
                "Purged %(count)d expired %(name)s.",
                "Purged %(count)d expired %(plural)s.",
                result.deleted,
            )
            % {"count": result.deleted, **names},
            messages.SUCCESS,
        )
        if not result.finished:
            self.message_user(
                request,
                _(
                    "More expired %(plural)s remain: the purge stops after %(seconds)d seconds "
                    "in the admin. Run it again, or let the scheduled purge finish."
                )
                % {"seconds": ADMIN_PURGE_SECONDS, **names},
                messages.WARNING,
            )

    def get_urls(self) -> list[URLPattern]:
        opts = self.model._meta
        purge = path(
            "purge-expired/",
            self.admin_site.admin_view(require_POST(self.purge_expired_view)),
            name=f"{opts.app_label}_{opts.model_name}_purge_expired",
        )
        return [purge, *super().get_urls()]

    def purge_expired_view(self, request: HttpRequest) -> HttpResponse:
        self._purge_and_report(request)
        opts = self.model._meta
        return HttpResponseRedirect(
            reverse(
                f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_changelist",
            )
        )

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        opts = self.model._meta
        context = {
            "purge_expired_url": reverse(
                f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_purge_expired"
            )
            if self.has_delete_permission(request)
            else None,
            **(extra_context or {}),
        }
        return super().changelist_view(request, context)


# --- The three admins -------------------------------------------------------------------------


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ProtectedRecordAdmin, PurgeExpiredMixin):
    list_display = (
        "key",
        "owner_scope",
        "request_line",
        "state",
        "response_status",
        "encryption_column",
        "created_at",
        "expires_at",
        "expired",
    )
    actions = ["purge_expired", "erase_owners"]
    list_filter = (
        "state",
        StatusClassFilter,
        ExpiredFilter,
        recent_values_filter("path", "created_at", str(_("path (recent)"))),
    )
    # Each sortable column has an index: idem_record_created_idx, idem_record_expires_idx.
    sortable_by = ("created_at", "expires_at", "expired")
    ordering = ("-created_at",)
    date_hierarchy = "created_at"
    search_fields = ("key", "owner")
    search_help_text = _("An exact idempotency key or owner scope.")
    readonly_fields = (
        "owner_scope",
        "request_line",
        "expired",
        "encryption",
        "stored_headers",
        "stored_body",
    )
    fieldsets = (
        (_("Request"), {"fields": ("owner_scope", "key", "request_line", "fingerprint")}),
        (
            _("State"),
            {
                "fields": (
                    "state",
                    "token",
                    "locked_until",
                    "created_at",
                    "completed_at",
                    "expires_at",
                    "expired",
                )
            },
        ),
        (
            _("Stored response"),
            {"fields": ("response_status", "encryption", "stored_headers", "stored_body")},
        ),
    )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _ListWithoutBodies

    @admin.display(description=_("owner"))
    def owner_scope(self, obj: IdempotencyRecord) -> str:
        """The owner, with an ``auth:`` HMAC cut short: it is derived from a credential."""
        return display_owner(obj.owner)

    @admin.display(description=_("request"), ordering=None)
    def request_line(self, obj: IdempotencyRecord) -> str:
        return f"{obj.method} {Truncator(obj.path).chars(80)}"

    @admin.display(description=_("response headers"))
    def stored_headers(self, obj: IdempotencyRecord) -> SafeString:
        """Decrypted when the record is encrypted (see ``encryption``)."""
        return render_to_string(
            "django_idempotency/admin/stored_headers.html",
            {"headers": header_pairs(shown_response(obj).headers)},
        )

    @admin.display(description=_("response body"))
    def stored_body(self, obj: IdempotencyRecord) -> SafeString:
        shown = shown_response(obj)
        preview = preview_body(shown.body, _content_type(shown.headers))
        return render_to_string(
            "django_idempotency/admin/stored_body.html",
            {
                "preview": preview,
                "preview_chars": PREVIEW_CHARS,
                "binary_preview_bytes": BINARY_PREVIEW_BYTES,
            },
        )


@admin.register(ProcessedEvent)
class ProcessedEventAdmin(PurgeExpiredMixin):
    list_display = ("event_id", "consumer", "topic", "processed_at", "expires_at", "expired")
    list_filter = (
        recent_values_filter("consumer", "processed_at", str(_("consumer (recent)"))),
        recent_values_filter("topic", "processed_at", str(_("topic (recent)"))),
        ExpiredFilter,
    )
    # Each sortable column has an index: idem_event_processed_idx, idem_event_expires_idx.
    sortable_by = ("processed_at", "expires_at", "expired")
    ordering = ("-processed_at",)
    search_fields = ("event_id",)
    search_help_text = _("An exact event id.")
    readonly_fields = ("expired",)
    fields = ("event_id", "consumer", "topic", "processed_at", "expires_at", "expired")


class LastErrorColumns:
    """The ``last_error`` column of deliveries and outbox messages: its last line, and in full."""

    @admin.display(description=_("last error"))
    def short_error(self, obj: Any) -> str:
        lines = str(obj.last_error).strip().splitlines()
        return Truncator(lines[-1] if lines else "").chars(80)

    @admin.display(description=_("last error"))
    def error_text(self, obj: Any) -> SafeString:
        return render_to_string(
            "django_idempotency/admin/stored_body.html",
            {
                "preview": preview_body(str(obj.last_error).encode(), "text/plain; charset=utf-8"),
                "preview_chars": PREVIEW_CHARS,
                "binary_preview_bytes": BINARY_PREVIEW_BYTES,
            },
        )


@admin.register(EventDelivery)
class EventDeliveryAdmin(LastErrorColumns, PurgeExpiredMixin):
    list_display = (
        "event_id",
        "consumer",
        "topic",
        "deliveries",
        "parked",
        "last_delivered_at",
        "short_error",
    )
    list_filter = (
        ParkedFilter,
        recent_values_filter("consumer", "id", str(_("consumer (recent)"))),
        ExpiredFilter,
    )
    # Sortable only by indexed columns: the primary key (newest first) and parked_at.
    sortable_by = ("parked",)
    ordering = ("-id",)
    search_fields = ("event_id",)
    search_help_text = _("An exact event id.")
    readonly_fields = ("parked", "expired", "error_text")
    fields = (
        "event_id",
        "consumer",
        "topic",
        "deliveries",
        "parked",
        "parked_at",
        "first_delivered_at",
        "last_delivered_at",
        "expires_at",
        "expired",
        "error_text",
    )

    @admin.display(boolean=True, description=_("parked"), ordering="parked_at")
    def parked(self, obj: EventDelivery) -> bool:
        return obj.parked_at is not None


# --- The outbox ---------------------------------------------------------------------------------


@admin.register(OutboxEntry)
class OutboxEntryAdmin(ProtectedOutboxAdmin, LastErrorColumns, PurgeExpiredMixin):
    """Outbox messages: pending (with their lag), sent, and parked ones to requeue."""

    list_display = (
        "event_id",
        "destination",
        "transport",
        "ordering_key",
        "state",
        "attempts",
        "lag",
        "created_at",
        "due_at",
        "available_at",
        "short_error",
    )
    list_filter = (
        "state",
        recent_values_filter("transport", "id", str(_("transport (recent)"))),
        recent_values_filter("destination", "id", str(_("destination (recent)"))),
        ExpiredFilter,
    )
    # Sortable only by the primary key (newest first), which every index ends with.
    sortable_by = ()
    ordering = ("-id",)
    search_fields = ("event_id", "ordering_key")
    search_help_text = _("An exact event id or ordering key.")
    readonly_fields = ("lag", "expired", "stored_payload", "error_text", "call")
    fields = (
        "event_id",
        "destination",
        "transport",
        "ordering_key",
        "state",
        "attempts",
        "lag",
        "due_at",
        "available_at",
        "locked_until",
        "created_at",
        "sent_at",
        "expires_at",
        "expired",
        "call",
        "stored_payload",
        "headers",
        "error_text",
    )
    actions = ["purge_expired", "requeue"]

    @admin.display(description=_("lag"))
    def lag(self, obj: OutboxEntry) -> str:
        """Pending or parked: how long it has waited. Sent: how long it took. Both counted from
        when it was due, for a delayed message. Read from the log: nothing this table knows
        (the connector's own lag is the figure)."""
        if obj.state == OutboxEntry.State.EXTERNAL:
            return "-"
        if obj.available_at is not None and obj.available_at.year == 9999:  # unscheduled
            return str(_("until the commit starts its countdown"))
        end = obj.sent_at if obj.sent_at is not None else timezone.now()
        start = obj.created_at
        if obj.due_at is not None and obj.due_at > start:
            if obj.sent_at is None and end < obj.due_at:
                left = (obj.due_at - end).total_seconds()
                return str(_("due in %(seconds).1f s")) % {"seconds": left}
            if obj.sent_at is None or obj.sent_at > obj.due_at:
                start = obj.due_at  # held until due: the wait after it is the lag
        return f"{max((end - start).total_seconds(), 0.0):.1f} s"

    @admin.display(description=_("call"))
    def call(self, obj: OutboxEntry) -> str:
        """A Celery message's call as its task receives it (kombu's types decoded): the
        ``payload`` below holds it as stored."""
        payload = obj.payload
        if not isinstance(payload, dict) or not {"args", "kwargs"} <= set(payload):
            return "-"
        try:
            from django_idempotency.outbox.celery_calls import decode

            args, kwargs = decode(payload["args"]), decode(payload["kwargs"])
        except Exception:  # noqa: BLE001 - no kombu, or a value it cannot decode: shown as stored
            return "-"
        shown = [repr(value) for value in args]
        shown += [f"{name}={value!r}" for name, value in dict(kwargs).items()]
        text = f"{obj.destination}({', '.join(shown)})"
        return text if len(text) <= 2000 else text[:2000] + "..."

    @admin.display(boolean=True, description=_("expired"))
    def expired(self, obj: Any) -> bool:
        return obj.expires_at is not None and bool(obj.expires_at <= timezone.now())

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        opts = self.model._meta
        return bool(request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}"))

    @admin.action(
        description=_("Requeue the selected parked messages (send them again)"),
        permissions=["requeue"],
    )
    def requeue(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        count = queryset.filter(state=OutboxEntry.State.PARKED).update(
            state=OutboxEntry.State.PENDING, attempts=0, available_at=None, locked_until=None
        )
        self.message_user(
            request,
            ngettext(
                "Requeued %(count)d parked message.",
                "Requeued %(count)d parked messages.",
                count,
            )
            % {"count": count},
            messages.SUCCESS,
        )


@admin.register(FlowRun)
class FlowRunAdmin(ProtectedFlowRunAdmin, ReadOnlyLogAdmin):
    """Phased requests (``@idempotent(phases=True)``): where each one stopped, and why.

    Read-only, and rows cannot be deleted here: a retry or the completer resumes a run from its
    recovery point, and a deleted run would make the next retry start the flow again from its
    first phase. Runs go with their record when the purge or a delete removes it.
    """

    list_display = (
        "record_id",
        "flow",
        "state",
        "recovery_point",
        "started",
        "attempts",
        "created_at",
        "updated_at",
    )
    list_filter = ("state",)
    sortable_by = ()
    ordering = ("-id",)
    search_fields = ("flow",)
    search_help_text = _("An exact flow name, module:qualname.")
    # The stored request and results, decrypted when they are encrypted, instead of the raw
    # columns.
    readonly_fields = ("stored_request", "stored_results")
    fields = (
        "record",
        "flow",
        "fingerprint",
        "state",
        "recovery_point",
        "started",
        "attempts",
        "last_error",
        "created_at",
        "updated_at",
        "stored_request",
        "stored_results",
    )

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False
