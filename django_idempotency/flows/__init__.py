"""Multi-step flows that call other systems: atomic phases with recovery points.

* :mod:`.phases`: ``@idempotent(phased=True)`` views and their :class:`~.phases.Flow`;
* :mod:`.completer`: finishes runs abandoned past their lease (``idempotency_complete``);
* :mod:`.sagas`: one saga step per task, each effect once, with its compensation.
"""
