"""The test matrix: Django 5.2 LTS, 6.0 and 6.1 on Python 3.11 to 3.13, run with nox.

``scripts/test.sh`` (``make test``) runs the quality gates, then every session below, then
prints the summary table. To run one combination by hand::

    nox -s "tests(6.1-py3.13)"          # its backends as the plan below says
    QUICK=1 nox -s "tests(5.2-py3.11)"  # without the slow tests
    nox -s lowest                       # the lowest declared version of every dependency
    nox -s install                      # the built wheel, installed bare and with each extra

The test command runs the main combination first and alone, then the other sessions in
``JOBS`` parallel lanes (see :func:`lanes`), each with its own test databases.

Each pass writes a JUnit report and one line to ``.reports/passes.jsonl``; ``scripts/summary.py``
turns them into the table. The interpreters are found the way pyenv does (``pyenv prefix``), so
3.12 and 3.13 need not be on ``PATH``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from configparser import ConfigParser
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
REPORTS = ROOT / ".reports"
PYTHONS = ["3.11", "3.12", "3.13"]

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_missing_interpreters = True
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lowest", "install"]

DATABASE_URLS = {
    "sqlite": "",
    "postgres": "postgres://postgres@127.0.0.1:5432/postgres",
    "mariadb": "mysql://root@127.0.0.1:3306/test",
}
PGBOUNCER_URL = "postgres://postgres@127.0.0.1:6432/postgres"

# (Django, Python): the database passes, and whether the slow tests run there. The first is the
# main combination, the newest Django on the newest Python: the full suite, slow tests included,
# on every backend, then the passes through PgBouncer and against Tansu. The others check the
# versions with the quick suite, pairwise: every supported Django and every supported Python runs
# at least once, both ends of the range included (Django 6.0 on Python 3.12; Django 5.2 on Python
# 3.11, the oldest, and again in the "lowest" session, on SQLite and PostgreSQL, with every
# dependency at its minimum: that SQLite pass is the oldest combination's). The other pairs of
# the table add nothing these do not test, and each quick pass costs minutes of the 25-minute
# budget on two cores. SQLite is the same library under every
# interpreter here (pyenv builds link the system's libsqlite3), and the slow tests (real workers,
# brokers, crashes) take most of a pass, so running either again would cost much for little.
MAIN = ("6.1", "3.13")
PLAN: dict[tuple[str, str], tuple[tuple[str, ...], bool]] = {
    MAIN: (("sqlite", "postgres", "mariadb"), True),
    ("6.0", "3.12"): (("postgres",), False),
    ("5.2", "3.11"): (("postgres",), False),
}
# The extras every session installs. Django 5.2 also gets the django.tasks backport.
EXTRAS = "dev,postgres,mysql,celery,redis,kafka"
# Extras whose requirements the lowest job pins to their declared minimum (dev tools stay new).
RUNTIME_EXTRAS = (
    "celery",
    "postgres",
    "mysql",
    "redis",
    "kafka",
    "drf",
    "tasks",
    "ninja",
    "dramatiq",
    "crypto",
)


def _find_interpreters() -> None:
    """Put pyenv's 3.11, 3.12 and 3.13 on PATH: its shims answer only for the global version."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    pyenv = shutil.which("pyenv") or shutil.which("pyenv", path=str(root / "bin"))
    if pyenv is None:
        return
    found = []
    for version in PYTHONS:
        answer = subprocess.run(
            [pyenv, "prefix", version], capture_output=True, text=True, check=False
        )
        if answer.returncode == 0:
            found.append(str(Path(answer.stdout.strip()) / "bin"))
    os.environ["PATH"] = os.pathsep.join([*found, os.environ.get("PATH", "")])
    # uv must use these interpreters, never fetch one.
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")


_find_interpreters()


def _marks(slow: bool) -> list[str]:
    return [] if slow else ["-m", "not slow"]


def _install(session: nox.Session, django: str, extras: str = EXTRAS, *args: str) -> None:
    if django == "5.2":
        extras += ",tasks"
    session.install("-e", f".[{extras}]", f"Django~={django}.0", *args)


def _record(**entry: object) -> None:
    REPORTS.mkdir(exist_ok=True)
    with (REPORTS / "passes.jsonl").open("a") as lines:
        lines.write(json.dumps(entry) + "\n")


def _pass_command(
    session: nox.Session,
    combination: str,
    backend: str,
    pytest_args: list[str],
    *,
    label: str | None = None,
    env: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str], Path]:
    """The command, environment and JUnit report of one pytest pass."""
    name = label or backend
    junit = REPORTS / f"{combination}-{name}.xml"
    junit.unlink(missing_ok=True)
    REPORTS.mkdir(exist_ok=True)
    run_env = {
        **os.environ,
        "PATH": os.pathsep.join([session.bin, os.environ.get("PATH", "")]),
        "VIRTUAL_ENV": str(Path(session.bin).parent),
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": DATABASE_URLS[backend],
        "TEST_DB_BACKEND": backend,
        **(env or {}),
    }
    command = [
        str(Path(session.bin) / "python"),
        "-m",
        "pytest",
        "-W",
        "error::DeprecationWarning",
        f"--junitxml={junit}",
        *pytest_args,
        *session.posargs,
    ]
    return command, run_env, junit


def _finish_pass(
    session: nox.Session, combination: str, name: str, code: int, seconds: float, junit: Path
) -> bool:
    """Record one finished pass for the summary and say whether it passed.

    pytest's exit 5 (no test collected, or all deselected) fails the pass: no selection here,
    not even ``-m pooler``, may be empty.
    """
    _record(
        combination=combination,
        backend=name,
        exit=code,
        ok=code == 0,
        seconds=round(seconds, 1),
        junit=str(junit),
    )
    if code == 5:
        session.warn(f"pytest on {name} collected no test (exit 5)")
    return code == 0


def _pytest(
    session: nox.Session,
    combination: str,
    backend: str,
    pytest_args: list[str],
    *,
    label: str | None = None,
    env: dict[str, str] | None = None,
) -> bool:
    """One pytest pass, in the foreground; record it for the summary and say if it passed."""
    command, run_env, junit = _pass_command(
        session, combination, backend, pytest_args, label=label, env=env
    )
    name = label or backend
    session.log(f"pytest on {name}: {' '.join(command[3:])}")
    started = time.monotonic()
    code = subprocess.run(command, env=run_env, cwd=ROOT, check=False).returncode
    return _finish_pass(session, combination, name, code, time.monotonic() - started, junit)


def _start_pass(
    session: nox.Session,
    combination: str,
    backend: str,
    pytest_args: list[str],
    *,
    label: str | None = None,
    env: dict[str, str] | None = None,
    after: Callable[[], object] | None = None,
) -> Callable[[], bool]:
    """Start one pytest pass in the background; returns a function that waits for it, prints
    its log (``.reports/<combination>-<label>.log``), calls ``after``, records the pass and
    says whether it passed."""
    name = label or backend
    command, run_env, junit = _pass_command(
        session, combination, backend, pytest_args, label=label, env=env
    )
    log = REPORTS / f"{combination}-{name}.log"
    session.log(f"pytest on {name} (log: {log.relative_to(ROOT)}): {' '.join(command[3:])}")
    output = log.open("w")
    started = time.monotonic()
    process = subprocess.Popen(
        command, env=run_env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT
    )
    # The pass's own time, not the time until it is collected (passes are collected in order).
    ended: list[float] = []
    watcher = threading.Thread(
        target=lambda: (process.wait(), ended.append(time.monotonic())), daemon=True
    )
    watcher.start()

    def finish() -> bool:
        code = process.wait()
        watcher.join()
        seconds = ended[0] - started
        output.close()
        if after is not None:
            after()
        print(f"\n----- pytest on {name} ({seconds:.0f}s, exit {code}) -----", flush=True)
        print(log.read_text(), flush=True)
        return _finish_pass(session, combination, name, code, seconds, junit)

    return finish


# pytest-xdist workers for a backend's pass in the main combination. Most of a slow pass is spent
# waiting on worker processes, brokers and sleeps, so two workers (whole files each, each with a
# test database of its own) nearly halve a PostgreSQL or MariaDB pass even on two cores. SQLite's
# pass is the shortest and stays in one process.
WORKERS = {"postgres": 2, "mariadb": 2}


def _workers(backend: str) -> list[str]:
    workers = int(os.environ.get("WORKERS", "0")) or WORKERS.get(backend, 1)
    return ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []


def _pytest_together(
    session: nox.Session,
    combination: str,
    backends: tuple[str, ...],
    pytest_args: list[str],
    beside: dict[str, Callable[[], Callable[[], bool]]] | None = None,
) -> list[str]:
    """One pass per backend, all at once, and the passes ``beside`` starts (the PgBouncer and
    Tansu passes); returns the names of the passes that failed.

    The passes use three different database servers (or test databases of their own), so
    they cannot collide, and most of a slow pass is spent waiting on subprocesses, brokers and
    sleeps: side by side they take little longer than the longest alone. Each writes its output
    to ``.reports/<combination>-<backend>.log``, printed whole when it ends, and its coverage
    data to ``.coverage.<backend>`` (combined afterwards).
    """
    running: list[tuple[str, Callable[[], bool]]] = []
    for backend in backends:
        # sys.monitoring (Python 3.12+): line coverage at almost no cost (pyproject.toml).
        env = {"COVERAGE_FILE": str(ROOT / f".coverage.{backend}"), "COVERAGE_CORE": "sysmon"}
        args = [*pytest_args, *_workers(backend)]
        running.append((backend, _start_pass(session, combination, backend, args, env=env)))
    for name, start in (beside or {}).items():
        running.append((name, start()))
    return [name for name, finish in running if not finish()]


def _services_up(
    session: nox.Session, combination: str, backends: tuple[str, ...]
) -> tuple[str, ...]:
    """The backends to run: one unreachable is skipped loudly (fails with REQUIRE_SERVICES=1)."""
    sys.path.insert(0, str(ROOT))
    from tests.services import reachable

    names = {"postgres": "postgres", "mariadb": "mariadb"}
    down = [b for b in backends if b in names and not reachable(names[b])]
    for backend in down:
        message = f"!!! {backend} is UNREACHABLE: its pass is SKIPPED !!!"
        if os.environ.get("REQUIRE_SERVICES") == "1":
            session.error(f"{backend} is unreachable and REQUIRE_SERVICES=1")
        session.warn(message)
        _record(combination=combination, backend=backend, exit=None, ok=True, unreachable=True)
    return tuple(b for b in backends if b not in down)


@nox.session
@nox.parametrize(
    "python,django",
    [(python, django) for django, python in PLAN],
    ids=[f"{django}-py{python}" for django, python in PLAN],
)
def tests(session: nox.Session, django: str) -> None:
    """The suite on one (Django, Python) combination, on the backends the plan names."""
    python = str(session.python)
    backends, slow = PLAN[(django, python)]
    if only := os.environ.get("BACKENDS"):
        backends = tuple(b for b in backends if b in only.split())
    if os.environ.get("QUICK") == "1":
        slow = False
    _install(session, django)
    session.run(
        "python", "-c", "import django, sys; print('Django', django.__version__, sys.version)"
    )
    combination = f"django{django}-py{python}"
    main = (django, python) == MAIN
    if main:
        for stale in ROOT.glob(".coverage*"):
            stale.unlink()
        session.run("python", "manage.py", "makemigrations", "--check", "--dry-run")
    up = _services_up(session, combination, backends)
    if main:
        # Every backend at once, with coverage, and beside them the PgBouncer pass and the
        # Tansu pass (each mostly waiting, each on test databases of its own); see
        # _pytest_together.
        coverage = ["--cov", "--cov-report="]
        beside = {
            "pgbouncer": lambda: _pgbouncer_pass(session, combination),
            "tansu": lambda: _second_broker_pass(session, combination),
        }
        failed = _pytest_together(session, combination, up, [*coverage, *_marks(slow)], beside)
        session.run("python", "-m", "coverage", "combine", "--quiet")
        session.run("python", "-m", "coverage", "report", "--skip-covered")
    else:
        failed = [
            backend for backend in up if not _pytest(session, combination, backend, _marks(slow))
        ]
    if failed:
        session.error(f"pytest failed on: {', '.join(failed)}")


def _pgbouncer_pass(session: nox.Session, combination: str) -> Callable[[], bool]:
    """Start ``pytest -m pooler`` through PgBouncer in transaction mode (scripts/pgbouncer.sh),
    on test databases of its own; returns the function that waits for it (see _start_pass)."""
    script = ROOT / "scripts" / "pgbouncer.sh"
    if not script.exists():
        session.warn("scripts/pgbouncer.sh does not exist: the PgBouncer pass is not run")
        _record(combination=combination, backend="pgbouncer", exit=None, ok=True, absent=True)
        return lambda: True
    if subprocess.run([str(script), "start"], cwd=ROOT, check=False).returncode != 0:
        session.warn("!!! PgBouncer did not start: the pooler pass FAILS !!!")
        _record(combination=combination, backend="pgbouncer", exit=None, ok=False)
        return lambda: False
    suffix = os.environ.get("TEST_DB_SUFFIX", "") + "_pgbouncer"
    env = {"DATABASE_URL": PGBOUNCER_URL, "PGBOUNCER": "1", "TEST_DB_SUFFIX": suffix}
    return _start_pass(
        session, combination, "postgres", ["-m", "pooler"], label="pgbouncer", env=env
    )


def _second_broker_pass(session: nox.Session, combination: str) -> Callable[[], bool]:
    """Start ``pytest -m second_broker`` against Tansu (scripts/tansu.sh), a Kafka-compatible
    broker written independently of librdkafka, whose mock cluster the other passes use; returns
    a function that waits for the pass, stops the broker if this started it, and says if it
    passed."""
    script = ROOT / "scripts" / "tansu.sh"
    was_up = subprocess.run([str(script), "status"], cwd=ROOT, capture_output=True).returncode == 0
    if subprocess.run([str(script), "start"], cwd=ROOT, check=False).returncode != 0:
        session.warn("!!! Tansu did not start: the second broker pass FAILS !!!")
        _record(combination=combination, backend="tansu", exit=None, ok=False)
        return lambda: False
    port = os.environ.get("TANSU_PORT", "19092")
    suffix = os.environ.get("TEST_DB_SUFFIX", "") + "_tansu"
    env = {"KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{port}", "TEST_DB_SUFFIX": suffix}

    def stop() -> None:
        if not was_up:
            subprocess.run([str(script), "stop"], cwd=ROOT, check=False)

    return _start_pass(
        session,
        combination,
        "postgres",
        ["-m", "second_broker"],
        label="tansu",
        env=env,
        after=stop,
    )


SHOW_VERSIONS = """
import sys
from importlib.metadata import version
print("installed:", ", ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
"""


def lowest_constraints() -> list[str]:
    """``==`` pins for the declared minimum of Django, asgiref and each runtime extra."""
    config = ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirements = config["options"]["install_requires"].split()
    extras = config["options.extras_require"]
    for extra in RUNTIME_EXTRAS:
        requirements += [line for line in extras[extra].splitlines() if line.strip()]
    pins = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?>=([^,;\s]+)", requirement.strip())
        if match is None:
            raise ValueError(f"setup.cfg: {requirement!r} has no plain '>=' minimum")
        name, version = match.group(1).lower(), match.group(3)
        pins[name] = version
    if "psycopg" in pins:  # psycopg[binary] pins its binary part to the same version
        pins["psycopg-binary"] = pins["psycopg"]
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


@nox.session(python=PYTHONS[0])
def lowest(session: nox.Session) -> None:
    """The quick suite, every runtime dependency at its declared minimum, SQLite and PostgreSQL."""
    REPORTS.mkdir(exist_ok=True)
    constraints = REPORTS / "lowest-constraints.txt"
    constraints.write_text("\n".join(lowest_constraints()) + "\n")
    session.log("pinned: " + ", ".join(lowest_constraints()))
    _install(session, "5.2", EXTRAS, "-c", str(constraints))
    session.run(
        "python", "-c", SHOW_VERSIONS, *(pin.split("==")[0] for pin in lowest_constraints())
    )
    failed = [
        backend
        for backend in _services_up(session, "lowest-py3.11", ("sqlite", "postgres"))
        if not _pytest(session, "lowest-py3.11", backend, ["-m", "not slow"])
    ]
    if failed:
        session.error(f"pytest failed on: {', '.join(failed)}")


@nox.session(python=MAIN[1])
def install(session: nox.Session) -> None:
    """Build the wheel, install it in fresh venvs, bare and with each extra; import each module."""
    session.install("build", "uv")
    dist = REPORTS / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--wheel", "--outdir", str(dist), silent=True)
    (wheel,) = dist.glob("django_idempotency-*.whl")
    started = time.monotonic()
    session.run("python", str(ROOT / "scripts" / "check_install.py"), str(wheel))
    _record(
        combination=f"django{MAIN[0]}-py{MAIN[1]}",
        backend="wheel+extras",
        exit=0,
        ok=True,
        seconds=round(time.monotonic() - started, 1),
    )


def lanes(sessions: list[str], jobs: int) -> list[list[str]]:
    """Share ``sessions`` among ``jobs`` parallel lanes, the heaviest first (scripts/test.sh)."""

    def weight(name: str) -> int:
        # About a minute and a half per quick pass, and one for a session's set-up; a slow pass
        # takes about eight quick ones.
        match = re.fullmatch(r"tests\((\d\.\d)-py(\d\.\d+)\)", name)
        if match is None:
            return 3 if name == "lowest" else 1
        backends, slow = PLAN[(match.group(1), match.group(2))]
        slow = slow and os.environ.get("QUICK") != "1"
        return 1 + len(backends) * (8 if slow else 1)

    shares: list[list[str]] = [[] for _ in range(max(1, jobs))]
    loads = [0] * len(shares)
    for name in sorted(sessions, key=weight, reverse=True):
        lightest = loads.index(min(loads))
        shares[lightest].append(name)
        loads[lightest] += weight(name)
    return [share for share in shares if share]


if __name__ == "__main__":
    sys.exit("run this file with nox")
