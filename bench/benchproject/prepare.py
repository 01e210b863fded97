"""Migrate the current variant's database and create the benchmark user.

``python -m bench.benchproject.prepare`` with ``BENCH_VARIANT`` and ``BENCH_DATABASE_URL`` set.
"""

from __future__ import annotations

import os


def prepare() -> None:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.benchproject.settings")
    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from bench.benchproject.middleware import BENCH_USERNAME

    call_command("migrate", interactive=False, verbosity=0)
    get_user_model().objects.get_or_create(username=BENCH_USERNAME)


if __name__ == "__main__":
    prepare()
