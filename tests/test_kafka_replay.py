"""``idempotency_consume NAME --replay-dead-letters``: "nothing to replay" at once when no
dead-letter topic exists, and a wait for its consumer group that is bounded and said (issue 35,
item 4).

The quick tests run on :class:`tests.kafka_mock.MockCluster`, whose groups form at once unless
a test asks for a delay; the slow one runs ``manage.py`` processes on the cluster of the run
(librdkafka's mock cluster, or Tansu with ``KAFKA_BOOTSTRAP_SERVERS``), and SIGKILLs a replay.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

pytest.importorskip("confluent_kafka")

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from django_idempotency.conf import consumer_settings
from django_idempotency.kafka import replay
from django_idempotency.kafka.replay import group_wait, replay_dead_letters
from django_idempotency.kafka.runner import DeadLetterFailed
from django_idempotency.kafka.settings import parse_consumers
from tests.kafka_cluster import REPO, Cluster, consumer_env
from tests.kafka_mock import MockCluster
from tests.workers import database_url

pytestmark = [pytest.mark.timeout(60)]
DOCS = Path(__file__).resolve().parent.parent / "docs"
REPLAY = [sys.executable, "manage.py", "idempotency_consume", "--replay-dead-letters"]
PROJECT_WAIT = 60.0
"""The group wait of the test project's ``shop.kafka`` (session.timeout.ms 6 s): the replay
group's 45 s poll interval, plus 15 s."""


def entry(bootstrap: str, topic: str, **extra: Any) -> dict[str, Any]:
    return {
        "HANDLER": "testproject.shop.kafka_handlers.apply",
        "TOPICS": [topic],
        "GROUP": f"replay-{uuid.uuid4().hex[:8]}",
        "CONFIG": {"bootstrap.servers": bootstrap, "session.timeout.ms": 6000},
        **extra,
    }


@pytest.fixture
def consumer_named(kafka_mock: MockCluster) -> Iterator[dict[str, Any]]:
    """``shop.kafka`` consumes a topic of its own on the mock cluster (the setting, in force)."""
    topic = kafka_mock.new_topic("replay")
    consumer = entry(kafka_mock.bootstrap, topic)
    setting = {**django_settings.IDEMPOTENCY, "KAFKA_CONSUMERS": {"shop.kafka": consumer}}
    with override_settings(IDEMPOTENCY=setting):
        yield consumer


@pytest.mark.timeout(90)  # the replay waited two minutes for an assignment that never came
def test_without_a_dead_letter_topic_the_replay_says_nothing_to_replay_at_once(
    kafka_mock: MockCluster, consumer_named: dict[str, Any]
) -> None:
    out = StringIO()
    started = time.monotonic()
    call_command("idempotency_consume", "shop.kafka", "--replay-dead-letters", stdout=out)
    took = time.monotonic() - started

    [topic] = consumer_named["TOPICS"]
    assert out.getvalue().splitlines() == [
        f"no dead-letter topic exists ({topic}.dlq): nothing was dead-lettered",
        "nothing to replay",
    ]
    # Not a timing: the bug waited for an assignment that never came (the group's wait, 60 s,
    # and more); a fraction of that, however loaded the machine, shows it did not wait.
    assert took < 30, took
    # Read from the list of every topic: asking for it by name could have created it.
    reader = Consumer({"bootstrap.servers": kafka_mock.bootstrap, "group.id": "unused"})
    try:
        assert f"{topic}.dlq" not in reader.list_topics(timeout=10).topics
    finally:
        reader.close()


def test_the_replay_says_it_waits_for_its_group_and_gives_up_when_the_wait_is_over(
    kafka_mock: MockCluster, consumer_named: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group takes longer to form than the replay may wait (the brokers' initial rebalance
    delay, here 15 s, stands for a killed replay that holds the group): it said at once that it
    waits for the group, said it again while waiting, and gave up when the wait was over, with
    an error naming the group. Once the group forms in time, the same replay runs."""
    [topic] = consumer_named["TOPICS"]
    dead_letters = f"{topic}.dlq"
    kafka_mock.create_topic(dead_letters)
    producer = Producer({"bootstrap.servers": kafka_mock.bootstrap})
    headers = {"dlq.consumer": "another.consumer", "dlq.topic": topic}
    producer.produce(dead_letters, value=b"{}", headers=headers)
    assert producer.flush(10) == 0
    monkeypatch.setattr(replay, "WAIT_NOTICE_EVERY", 0.3)
    group = f"{consumer_named['GROUP']}.replay"
    lines: list[str] = []

    if not kafka_mock.sets_rebalance_delay:
        pytest.skip("this librdkafka cannot delay its mock groups' first assignment")
    kafka_mock.rebalance_delay(15000)  # far past the 1.5 s bound, however loaded the machine
    try:
        started = time.monotonic()
        with pytest.raises(DeadLetterFailed) as failed:
            replay_dead_letters("shop.kafka", join_timeout=1.5, echo=lines.append)
        took = time.monotonic() - started
    finally:
        kafka_mock.rebalance_delay(0)

    # It gave up (raised) before the group's assignment, 15 s away: the bound is what ended it.
    assert took >= 1.5, took
    assert lines[0] == f"waiting for group {group} to assign {dead_letters} (at most 1.5s)"
    assert any(line.startswith(f"still waiting for group {group} (") for line in lines[1:])
    assert f"group {group} assigned no partition of {dead_letters} within 1.5s" in str(
        failed.value
    )

    # The member that gave up mid-join holds this group for seconds more (its session): the
    # same replay in a group of its own.
    lines.clear()
    settings = replace(consumer_settings("shop.kafka"), group=f"{group}-again")
    # idle: how long it waits for a message once assigned (0.5 s read nothing on a loaded CI run).
    assert replay_dead_letters(settings, idle=3.0, echo=lines.append) == {"skipped": 1}
    group = f"{group}-again.replay"
    assert lines[0] == f"waiting for group {group} to assign {dead_letters} (at most 60s)"
    assert lines[1].startswith(f"group {group} assigned {dead_letters}[0], {dead_letters}[1]")


def test_the_longest_wait_for_the_group_is_the_documented_one() -> None:
    """A minute with librdkafka's defaults, as docs/kafka.md says; longer only with a longer
    session.timeout.ms (a killed replay holds the group that long)."""
    local = {"bootstrap.servers": "b:9092"}
    consumers = parse_consumers(
        "KAFKA_CONSUMERS",
        {
            "defaults": entry("b:9092", "t", CONFIG=local),
            "short": entry("b:9092", "t"),  # session.timeout.ms 6 s
            "long": entry(
                "b:9092",
                "t",
                CONFIG={"bootstrap.servers": "b:9092", "session.timeout.ms": "60000"},
            ),
        },
    )
    assert group_wait(consumers["defaults"]) == 60.0
    assert group_wait(consumers["short"]) == 60.0
    assert group_wait(consumers["long"]) == 75.0
    text = " ".join((DOCS / "kafka.md").read_text().split())
    assert "waits at most 60 seconds for its group" in text


# --- Slow: real processes, a SIGKILLed replay ---------------------------------------------------


def create_topic(cluster: Cluster, name: str) -> None:
    if cluster.is_mock:
        cluster.producer.list_topics(name, timeout=10)  # auto-created by the metadata request
    else:
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        for future in admin.create_topics([NewTopic(name, 4)]).values():
            future.result(30)


def start_replay(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [*REPLAY, "shop.kafka"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(log: Path, text: str, process: subprocess.Popen[bytes], timeout: float) -> float:
    """Seconds until ``text`` is in the log."""
    started = time.monotonic()
    while text not in log.read_text(errors="replace"):
        if process.poll() is not None and text not in log.read_text(errors="replace"):
            raise AssertionError(f"exited before {text!r}:\n{log.read_text()}")
        if time.monotonic() - started > timeout:
            raise AssertionError(f"no {text!r} within {timeout}s:\n{log.read_text()}")
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.slow
@pytest.mark.second_broker
@pytest.mark.timeout(360)  # above the sum of its waits (60 + 90 + 60 + 75 + 3 x 10 s)
@pytest.mark.django_db(transaction=True)
def test_a_replay_right_after_a_killed_one_says_it_waits_and_finishes_in_time(
    kafka_cluster: Cluster, tmp_path: Path
) -> None:
    """On the run's cluster (the mock one, or Tansu): with no dead-letter topic, the command
    says "nothing to replay" and exits 0 within seconds. Then a replay is SIGKILLed as soon as
    it holds the group's partitions, and another one starts at once: it says that it waits
    for the group before any assignment, and finishes, exit 0, within the documented wait (it
    printed nothing for over 70 s on the mock cluster)."""
    topic = kafka_cluster.new_topic("replay-kill")
    env = consumer_env(
        kafka_cluster,
        topic=topic,
        group=f"replay-{uuid.uuid4().hex[:8]}",
        db_url=database_url(connection.settings_dict),
    )
    started = time.monotonic()
    nothing = subprocess.run(
        [*REPLAY, "shop.kafka"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - started
    assert nothing.returncode == 0, nothing.stderr
    assert nothing.stdout.splitlines()[-1] == "nothing to replay", nothing.stdout
    # No time is asserted: the run's timeout (60 s) is half the two minutes it waited before.
    print(f"nothing to replay: exit 0 in {took:.1f}s, Django's start included")

    dead_letters = f"{topic}.dlq"
    create_topic(kafka_cluster, dead_letters)
    other = [{"dlq.consumer": "another.consumer", "dlq.topic": topic}] * 8
    producer = Producer({"bootstrap.servers": kafka_cluster.bootstrap})
    for headers in other:
        producer.produce(dead_letters, value=json.dumps({}).encode(), headers=headers)
    assert producer.flush(30) == 0

    first = start_replay(env, tmp_path / "first.log")
    try:
        wait_for(tmp_path / "first.log", " assigned ", first, timeout=90)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)

    second_log = tmp_path / "second.log"
    started = time.monotonic()
    second = start_replay(env, second_log)
    try:
        # The line comes once Django has started and the topics are read: 11 s for the whole
        # "nothing to replay" run above on a loaded CI machine, so the bound leaves room for
        # that; what matters is that it comes before any assignment, never after a silent wait.
        said = wait_for(second_log, "waiting for group ", second, timeout=60)
        status = second.wait(PROJECT_WAIT + 15)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(10)
    took = time.monotonic() - started
    output = second_log.read_text()
    if " assigned " in output:
        assert output.index("waiting for group ") < output.index(" assigned "), output
    print(f"replay after a SIGKILLed one: said it waits after {said:.1f}s, done in {took:.1f}s")
    assert status == 0, output  # second.wait() above gives up after the documented wait
    assert output.splitlines()[-1].endswith(("skipped", "nothing to replay")), output
