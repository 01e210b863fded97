#!/usr/bin/env bash
# The demo: the test project on SQLite at http://127.0.0.1:8000/, no services needed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh demo
export DJANGO_SETTINGS_MODULE=testproject.settings
unset DATABASE_URL CELERY_BROKER_URL
PY=.venv/bin/python
$PY manage.py migrate --noinput
$PY manage.py shell -c "
from django.contrib.auth import get_user_model
User = get_user_model()
if not User.objects.filter(username='admin').exists():
    User.objects.create_superuser('admin', 'admin@example.com', 'admin')
"
cat <<MSG

  django-idempotency demo
  -----------------------
  URL:    http://127.0.0.1:8000/
  Admin:  http://127.0.0.1:8000/admin/   login: admin / admin

MSG
exec $PY manage.py runserver 127.0.0.1:8000
