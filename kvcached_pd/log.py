"""kvcached-pd's log lines go wherever vLLM's own lines go.

Every module logs to the ``kvcached_pd`` logger (children of it included), with
messages starting ``kvcached-pd:`` that harnesses grep for. Under a plain ``vllm
serve`` that logger has no handler: vLLM configures only its ``vllm`` logger
(``VLLM_CONFIGURE_LOGGING``, handler to stdout at ``VLLM_LOGGING_LEVEL``, no
propagation), so Python's last-resort handler would show WARNING and above and drop
the start-up line, the staging line and the ``KVCACHED_PD_TRACE`` lines (INFO).

:func:`follow_vllm_logging` runs as a post-import hook on ``vllm.logger`` (registered
by activation with the gate open: the gate-closed path imports nothing of vLLM). It
gives ``kvcached_pd`` vLLM's level and a handler that hands each record to vLLM's
logger, so vLLM's format, stream, level and any ``VLLM_LOGGING_CONFIG_PATH`` apply,
as for vLLM's own modules. An operator who configured ``kvcached_pd`` (a handler or a
level of its own) keeps that configuration untouched.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "kvcached_pd"
VLLM_LOGGER_NAME = "vllm"

logger = logging.getLogger(LOGGER_NAME)


class ToVllmLogger(logging.Handler):
    """Hands each record to vLLM's logger, whose handlers format and write it."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(VLLM_LOGGER_NAME).handle(record)


def follow_vllm_logging(_module=None) -> bool:
    """Route ``kvcached_pd`` through vLLM's logging; True if this call changed anything."""
    ours = logging.getLogger(LOGGER_NAME)
    if ours.handlers or ours.level != logging.NOTSET:
        return False  # configured already: by the operator, or by an earlier call
    ours.addHandler(ToVllmLogger())
    ours.setLevel(logging.getLogger(VLLM_LOGGER_NAME).getEffectiveLevel())
    ours.propagate = False  # vLLM's own loggers do not propagate either: no duplicates
    return True
