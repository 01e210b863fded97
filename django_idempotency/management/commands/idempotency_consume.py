"""``manage.py idempotency_consume <consumer>``: run one Kafka consumer of ``KAFKA_CONSUMERS``."""

from __future__ import annotations

import signal
from argparse import ArgumentParser
from types import FrameType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from django_idempotency.conf import consumer_settings


class Command(BaseCommand):
    help = (
        'Consume Kafka with a consumer of IDEMPOTENCY["KAFKA_CONSUMERS"]: each event is applied '
        "once, in one transaction with its processed-event row, and its offset is committed "
        "after that transaction. SIGTERM or SIGINT stops after the current message."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("consumer", help='A name in IDEMPOTENCY["KAFKA_CONSUMERS"].')
        parser.add_argument(
            "--replay-dead-letters",
            action="store_true",
            help="Instead of consuming: put the consumer's dead-lettered messages back on their "
            "topics (un-parking their events), then exit. Says 'nothing to replay' at once when "
            "no dead-letter topic exists, and waits at most a minute (by default) for its "
            "consumer group.",
        )

    def _say(self, line: str) -> None:
        """A progress line of the replay, shown at once (stdout may be a pipe to a log)."""
        self.stdout.write(line)
        self.stdout.flush()

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            settings = consumer_settings(options["consumer"])
            from django_idempotency.kafka.replay import replay_dead_letters
            from django_idempotency.kafka.runner import ConsumerRunner, DeadLetterFailed
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        except ImportError as exc:
            raise CommandError(
                f"{exc}. Install the extra: pip install 'django-idempotency[kafka]'."
            ) from exc
        if options["replay_dead_letters"]:
            try:
                replayed = replay_dead_letters(settings, echo=self._say)
            except DeadLetterFailed as exc:
                raise CommandError(
                    f"{exc}. The dead letters not replayed stay on their topic: run this "
                    "again once the cause is fixed."
                ) from exc
            self.stdout.write(
                ", ".join(f"{n} {what}" for what, n in sorted(replayed.items()))
                or "nothing to replay"
            )
            return
        runner = ConsumerRunner(settings)

        def stop(signum: int, frame: FrameType | None) -> None:
            self.stderr.write(f"{signal.Signals(signum).name}: stopping after this message")
            runner.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self.stdout.write(f"consuming as {settings.name} (group {settings.group})")
        runner.run()
        counts = ", ".join(f"{n} {o.value}" for o, n in runner.counts.items()) or "no messages"
        self.stdout.write(f"stopped: {counts}")
