"""kvoffload's log lines inside vLLM come out through vLLM's logging set-up.

vLLM configures one logger, ``vllm`` (its handler, format with level, time and
process name, ``VLLM_LOGGING_LEVEL``; ``propagate=False``), and leaves the
root logger alone. kvoffload's core modules log under ``kvoffload.*`` (a
Redis tier unreachable or back, a full disk, dropped blocks): inside a vLLM
server nothing handles those names, so Python's last-resort handler printed
the bare message, with no level, and a user grepping vLLM's ``WARNING`` lines
never saw them.

``install()`` adds one handler to the ``kvoffload`` logger that hands each
record, renamed ``vllm.<its name>``, to the handlers of that vLLM logger and
its parents up to (not including) the root logger: vLLM's handlers, filters
and levels decide what is shown and how, exactly as for vLLM's own lines.

Invariants: installing twice adds nothing; records still propagate to the
root logger as before, once (an application's own handlers and pytest's
capture see each line once, whether or not vLLM's logger propagates); a
``kvoffload`` logger level set by the user is kept (only an unset one takes
vLLM's level, so INFO lines reach vLLM's handler when vLLM logs at INFO).
"""

from __future__ import annotations

import copy
import logging

#: The logger tree forwarded, and the prefix the records take inside vLLM.
SOURCE = "kvoffload"
VLLM_PREFIX = "vllm."


class ToVLLMHandler(logging.Handler):
    """Hands each record to the vLLM logger named ``vllm.<record's logger name>``."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # A copy: the same record goes on to the root logger's handlers under its own name.
            forwarded = copy.copy(record)
            forwarded.name = VLLM_PREFIX + record.name
            target = logging.getLogger(forwarded.name)
            if target.disabled or not target.isEnabledFor(record.levelno):
                return
            if not target.filter(forwarded):
                return
            # As Logger.callHandlers, but the root logger is left out: the original
            # record reaches it through kvoffload's own propagation, so where vLLM's
            # logger propagates (its logging left unconfigured) nothing shows twice.
            node: logging.Logger | None = target
            while node is not None and node is not logging.root:
                for handler in node.handlers:
                    if forwarded.levelno >= handler.level:
                        handler.handle(forwarded)
                node = node.parent if node.propagate else None
        except Exception:  # pragma: no cover - logging must never raise into the caller
            self.handleError(record)


_owned_level: int | None = None


def install() -> None:
    """Forward ``kvoffload.*`` records to vLLM's logging (idempotent; module docstring).

    Calling it again after vLLM's level changed takes the new level (unless the
    user set the ``kvoffload`` logger's level).
    """
    global _owned_level
    source = logging.getLogger(SOURCE)
    if not any(isinstance(h, ToVLLMHandler) for h in source.handlers):
        source.addHandler(ToVLLMHandler())
    if source.level in (logging.NOTSET, _owned_level):
        _owned_level = logging.getLogger(VLLM_PREFIX.rstrip(".")).getEffectiveLevel()
        source.setLevel(_owned_level)
