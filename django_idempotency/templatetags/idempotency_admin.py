"""Template tags for the idempotency admin pages.

``{% indexed_date_hierarchy cl %}`` replaces Django's ``{% date_hierarchy cl %}`` on the list
pages. Django's tag finds the days, months or years that hold rows with
``SELECT DISTINCT DATE_TRUNC(...)`` over the whole selection: on a million-row table that is a
full scan (about 200 ms on PostgreSQL) on every page view. This tag runs one
``MIN``/``MAX`` query instead, which the index on the date column answers, and links every day,
month or year between the two. A day without rows then shows an empty list. The span is the
table's (within the year and month picked), not the filtered selection's: the index answers
that in two probes, where the span of a filtered selection can take a walk of the whole index.
"""

from __future__ import annotations

import datetime
from typing import Any

from django import template
from django.contrib.admin.views.main import ChangeList
from django.db.models import Max, Min
from django.utils import formats, timezone
from django.utils.text import capfirst
from django.utils.translation import gettext as _

register = template.Library()


def _local(value: datetime.date | datetime.datetime) -> datetime.date | datetime.datetime:
    if isinstance(value, datetime.datetime) and timezone.is_aware(value):
        return timezone.localtime(value)
    return value


@register.inclusion_tag("admin/date_hierarchy.html")
def indexed_date_hierarchy(cl: ChangeList) -> dict[str, Any]:
    """The context of ``admin/date_hierarchy.html``, from one indexed MIN/MAX query."""
    field_name = str(cl.date_hierarchy)
    year_field, month_field, day_field = (
        f"{field_name}__{part}" for part in ("year", "month", "day")
    )
    year = cl.params.get(year_field)
    month = cl.params.get(month_field)
    day = cl.params.get(day_field)

    def link(filters: dict[str, Any]) -> str:
        return str(cl.get_query_string(filters, [f"{field_name}__"]))

    if year and month and day:
        selected = datetime.date(int(year), int(month), int(day))
        return {
            "show": True,
            "back": {
                "link": link({year_field: year, month_field: month}),
                "title": capfirst(formats.date_format(selected, "YEAR_MONTH_FORMAT")),
            },
            "choices": [{"title": capfirst(formats.date_format(selected, "MONTH_DAY_FORMAT"))}],
        }

    # The span of the whole table within the year and month picked, not of the filtered
    # selection: MIN and MAX are then two probes of the date column's index, whatever the
    # filters. Of a filtered selection, one of them walked the index past every row that did
    # not match (the expired filter's MAX: 0.25 s at a million rows, growing with the table).
    picked = {name: value for name, value in ((year_field, year), (month_field, month)) if value}
    rows = cl.root_queryset.filter(**picked).order_by()
    span = rows.aggregate(first=Min(field_name), last=Max(field_name))
    if span["first"] is None or span["last"] is None:
        return {
            "show": bool(year),
            "back": {"link": link({}), "title": _("All dates")},
            "choices": [],
        }
    first, last = _local(span["first"]), _local(span["last"])
    if not year and first.year == last.year:
        year = str(first.year)
        if first.month == last.month:
            month = str(first.month)

    if year and month:
        days = [
            datetime.date(int(year), int(month), number)
            for number in range(first.day, last.day + 1)
        ]
        return {
            "show": True,
            "back": {"link": link({year_field: year}), "title": str(year)},
            "choices": [
                {
                    "link": link({year_field: year, month_field: month, day_field: d.day}),
                    "title": capfirst(formats.date_format(d, "MONTH_DAY_FORMAT")),
                }
                for d in days
            ],
        }
    if year:
        months = [
            datetime.date(int(year), number, 1) for number in range(first.month, last.month + 1)
        ]
        return {
            "show": True,
            "back": {"link": link({}), "title": _("All dates")},
            "choices": [
                {
                    "link": link({year_field: year, month_field: m.month}),
                    "title": capfirst(formats.date_format(m, "YEAR_MONTH_FORMAT")),
                }
                for m in months
            ],
        }
    return {
        "show": True,
        "back": None,
        "choices": [
            {"link": link({year_field: str(number)}), "title": str(number)}
            for number in range(first.year, last.year + 1)
        ],
    }
