"""``manage.py idempotency_rotate_keys``: re-encrypt stored data with the newest key, in batches.

Also ``--decrypt``, which writes every sealed value in plaintext (with ``ENCRYPTION_MODE =
"decrypt-only"``, the way out of encryption), and ``--generate-key``, which prints a new key for
``ENCRYPTION_KEYS``.
"""

from __future__ import annotations

import base64
import os
import time
from argparse import ArgumentParser
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, OutputWrapper

from django_idempotency.conf import ENCRYPTION_KEY_BYTES, conf
from django_idempotency.management.arguments import add_batch_arguments
from django_idempotency.management.lost_database import resumable_on_loss
from django_idempotency.protection.core import (
    RotationError,
    RotationResult,
    decrypt_stored,
    rotate_keys,
)
from django_idempotency.protection.keys import keyring
from django_idempotency.retention.purge import purged_databases

BAR_WIDTH = 30


class ProgressBar:
    """A bar on ``stream`` per table: redrawn in place on a terminal, else a line per 10%."""

    def __init__(self, stream: OutputWrapper, started: float, verb: str) -> None:
        self.stream = stream
        self.verb = verb
        self.tty = stream.isatty()
        self.started = started
        self.shown: dict[str, int] = {}

    def __call__(self, table: str, done: int, last: int, resealed: int) -> None:
        share = 1.0 if last <= 0 else min(done / last, 1.0)
        tenth = int(share * 10)
        if not self.tty and self.shown.get(table, -1) >= tenth:
            return
        self.shown[table] = tenth
        filled = int(share * BAR_WIDTH)
        line = (
            f"{table}: [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {share:4.0%} "
            f"(id {done} of {last}), {resealed} {self.verb}, "
            f"{time.monotonic() - self.started:.1f}s"
        )
        ending = "" if self.tty else "\n"
        self.stream.write(f"\r{line}" if self.tty else line, style_func=str, ending=ending)
        self.stream.flush()

    def end(self) -> None:
        if self.tty and self.shown:
            self.stream.write("")


class Command(BaseCommand):
    help = (
        "Re-encrypt stored responses, phased requests and outbox payloads with the newest key "
        "of ENCRYPTION_KEYS, in batches of one short transaction each, beside live traffic. "
        "Stopped at any point, it goes on where it was when run again. With --decrypt, "
        "write them in plaintext instead (ENCRYPTION_MODE 'decrypt-only')."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        what = parser.add_mutually_exclusive_group()
        what.add_argument(
            "--generate-key",
            action="store_true",
            help="Print a new random key for ENCRYPTION_KEYS, and do nothing else.",
        )
        what.add_argument(
            "--decrypt",
            action="store_true",
            help="Write every encrypted value in plaintext, to turn encryption off. Refused "
            "unless IDEMPOTENCY['ENCRYPTION_MODE'] is 'decrypt-only' (deployed everywhere first).",
        )
        add_batch_arguments(
            parser,
            seconds_default=0,
            seconds_help="Time budget, 0 for none (the default); the next run goes on.",
        )
        parser.add_argument(
            "--database",
            default=None,
            metavar="ALIAS",
            help='The database alias to rotate (default: IDEMPOTENCY["DATABASE"]).',
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["generate_key"]:
            key = base64.urlsafe_b64encode(os.urandom(ENCRYPTION_KEY_BYTES)).decode("ascii")
            self.stdout.write(key)
            return
        try:
            ring = keyring()
        except (ImproperlyConfigured, ImportError) as exc:
            raise CommandError(str(exc)) from exc
        decrypt = options["decrypt"]
        if ring is not None and options["verbosity"]:
            self.stdout.write(
                f"Decrypting with the keys {', '.join(ring.key_ids)}."
                if decrypt
                else f"Newest key: {ring.newest_id}; "
                f"older keys still read: {', '.join(ring.key_ids[1:]) or 'none'}."
            )
        started = time.monotonic()
        verb = "decrypted" if decrypt else "re-encrypted"
        progress = ProgressBar(self.stderr, started, verb) if options["verbosity"] else None
        try:
            using = purged_databases(options["database"])[0]
            with resumable_on_loss([using], "rotation" if not decrypt else "decryption"):
                results = (decrypt_stored if decrypt else rotate_keys)(
                    using=using,
                    batch_size=options["batch_size"],
                    max_seconds=options["max_seconds"],
                    progress=progress,
                )
        except (RotationError, ValueError, ImproperlyConfigured) as exc:
            raise CommandError(str(exc)) from exc
        finally:
            if progress is not None:
                progress.end()
        for result in results:
            self.stdout.write(self._line(result, verb))
        if any(result.undecryptable for result in results):
            self.stdout.write(
                self.style.WARNING(
                    "Some rows open with none of the keys (each is logged at ERROR with its "
                    "key id): they were left as they are. Put their key back and run again."
                )
            )
        if any(result.changed for result in results):
            self.stdout.write(
                self.style.WARNING(
                    "Some rows changed meanwhile on every attempt (requests were using them): "
                    "they were left as they are. Run again to finish them."
                )
            )
        left = any(result.undecryptable or result.changed for result in results)
        if not all(result.finished for result in results):
            self.stdout.write(
                self.style.WARNING("The time budget ran out first; the next run goes on.")
            )
        elif decrypt and not left:
            # OUTBOX_ENCRYPT left behind the keys is E051, and outbox.send() fails (W053 said so).
            settings = "ENCRYPTION_KEYS and ENCRYPTION_MODE"
            if conf.OUTBOX_ENCRYPT:
                settings = "ENCRYPTION_KEYS, ENCRYPTION_MODE and OUTBOX_ENCRYPT"
            self.stdout.write(
                "Done: nothing is stored encrypted any more. Once every process runs with "
                "ENCRYPTION_MODE 'decrypt-only' (none started before the change writes), remove "
                f"{settings} together and deploy."
            )
        elif ring is not None and not left:
            self.stdout.write(
                f"Done: everything is sealed with key {ring.newest_id}. The older keys can be "
                "removed from ENCRYPTION_KEYS once no process started before this run writes."
            )

    @staticmethod
    def _line(result: RotationResult, verb: str) -> str:
        text = (
            f"{result.table}: {verb} {result.resealed} in {result.batches} "
            f"batch{'es' if result.batches != 1 else ''} ({result.seconds:.2f}s)"
        )
        if result.undecryptable:
            text += f", {result.undecryptable} undecryptable left as they are"
        if result.changed:
            text += f", {result.changed} changed meanwhile left for the next run"
        if not result.finished:
            text += ", stopped at the time budget"
        return text
