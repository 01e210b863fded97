"""The ``Idempotency-Key`` header: a request that runs once, and replays after that.

Read top down, each layer calls only the ones below it:

* adapters: :mod:`.decorators` (``@idempotent``), :mod:`.middleware`, :mod:`.drf`,
  :mod:`.ninja`;
* :mod:`.handler`: turns a Django request into a :class:`~.core.Command` and a stored
  :class:`~.core.Replay` back into a response (with :mod:`.keys`, :mod:`.owner` and
  :mod:`.fingerprint`);
* :mod:`.core`: decides (claim, run, store, replay, 409, 422), with no ``HttpRequest``;
* :mod:`.store`: the SQL per backend.

:mod:`.checks` holds the system checks that read the URL patterns.
"""
