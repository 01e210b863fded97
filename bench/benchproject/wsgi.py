"""WSGI entry point for gunicorn: ``bench.benchproject.wsgi:application``."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.benchproject.settings")
application = get_wsgi_application()
