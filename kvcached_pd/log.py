"""kvcached-pd's log lines go wherever vLLM's own lines go.

Every module logs to the ``kvcached_pd`` logger (children of it included), with
messages starting ``kvcached-pd:`` that harnesses grep for. Under a plain ``vllm
serve`` that logger has no handler: vLLM configures only its ``vllm`` logger
(``VLLM_CONFIGURE_LOGGING``, handler to stdout at ``VLLM_LOGGING_LEVEL``, no
propagation), so Python's last-resort handler would show WARNING and above and drop
the start-up line, the staging line and the ``KVCACHED_PD_TRACE`` lines (INFO).

:func:`follow_vllm_logging` runs as a post-import hook on ``vllm.logger`` (registered
by activation with the gate open: the gate-closed path imports nothing of vLLM). It
gives ``kvcached_pd`` a handler that hands each record to vLLM's logger, so vLLM's
format, stream and any ``VLLM_LOGGING_CONFIG_PATH`` apply, as for vLLM's own modules,
and vLLM's level, read at each use rather than copied once:

- vLLM 0.20-0.30 configure logging when ``vllm.logger`` is imported, so the level is
  known at once;
- vLLM 0.31+ configure it later, in each process (``configure_logging``, from the CLI
  or the engine's start): at import the ``vllm`` logger still has Python's default
  (WARNING), and a level copied then pinned kvcached-pd's INFO lines off for good.
  Until vLLM configures, INFO lines are held (the last 64) and handed to vLLM's
  handler once it has one; WARNING and above go on at once, as vLLM's own do then.

An operator who configured ``kvcached_pd`` (a handler or a level of its own) keeps that
configuration untouched.
"""

from __future__ import annotations

import collections
import functools
import logging
import os

LOGGER_NAME = "kvcached_pd"
VLLM_LOGGER_NAME = "vllm"
HELD = 64  # INFO records kept while vLLM has not configured logging yet

logger = logging.getLogger(LOGGER_NAME)


def _vllm() -> logging.Logger:
    return logging.getLogger(VLLM_LOGGER_NAME)


def vllm_configured() -> bool:
    """Whether vLLM has configured its logger (its handler, or at least its level), or
    never will (``VLLM_CONFIGURE_LOGGING=0``: its lines go to the operator's handlers
    through the root logger at once, and so do ours)."""
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1").strip() == "0":
        return True
    vllm = _vllm()
    return bool(vllm.handlers) or vllm.level != logging.NOTSET


def _vllm_level() -> int:
    level = _vllm().getEffectiveLevel()
    return level if vllm_configured() else min(level, logging.INFO)


class _FollowsVllmLevel(logging.Logger):
    """``kvcached_pd``'s logger whose level, unless set on it, is vLLM's at each use
    (``level`` is read by this logger and by its children walking up)."""

    @property  # type: ignore[override]
    def level(self) -> int:
        own = self.__dict__.get("_own_level", logging.NOTSET)
        return own if own != logging.NOTSET else _vllm_level()

    @level.setter
    def level(self, value: int) -> None:
        self.__dict__["_own_level"] = value


class ToVllmLogger(logging.Handler):
    """Hands each record to vLLM's logger, whose handlers format and write it."""

    def __init__(self) -> None:
        super().__init__()
        self.held: collections.deque[logging.LogRecord] = collections.deque(maxlen=HELD)

    def emit(self, record: logging.LogRecord) -> None:
        if not vllm_configured() and record.levelno < logging.WARNING:
            self.held.append(record)
            return
        self.release()
        if record.levelno >= _vllm().getEffectiveLevel():
            _vllm().handle(record)

    def release(self) -> None:
        """Hand the held records on, at vLLM's level (once it has configured logging)."""
        while self.held and vllm_configured():
            record = _as_made_now(self.held.popleft())
            if record.levelno >= _vllm().getEffectiveLevel():
                _vllm().handle(record)

    def release_to(self, logger: logging.Logger) -> None:
        """Hand the held records to ``logger``'s own handlers, at its level: vLLM
        configured logging from a file (``VLLM_LOGGING_CONFIG_PATH``) that names
        ``kvcached_pd`` and so replaced this handler, which then held the start-up and
        "applied" lines for nobody (2 x H200, vLLM 0.33.0, 2026-11-26: not one
        kvcached-pd line in the log of an instance kvcached stopped at engine start)."""
        while self.held:
            record = _as_made_now(self.held.popleft())
            if record.levelno >= logger.getEffectiveLevel():
                logger.handle(record)


def _as_made_now(record: logging.LogRecord) -> logging.LogRecord:
    """A held record with the fields the record factory installed since adds (vLLM
    0.31+'s configure_logging installs one whose ``vllm_process_name`` its format
    reads); its own fields, the time included, kept."""
    fresh = logging.getLogRecordFactory()(
        record.name, record.levelno, record.pathname, record.lineno, record.msg,
        record.args, record.exc_info, record.funcName, record.stack_info)
    fresh.__dict__.update(vars(record))
    return fresh


def _release_after(configure):
    @functools.wraps(configure)
    def configured(*args, **kwargs):
        ours = logging.getLogger(LOGGER_NAME)
        holders = [h for h in ours.handlers if isinstance(h, ToVllmLogger)]
        result = configure(*args, **kwargs)
        for handler in holders:
            if handler in ours.handlers:
                handler.release()
            else:  # a logging config that names kvcached_pd replaced it
                handler.release_to(ours)
        return result

    configured.__kvcached_pd_release__ = True
    return configured


def follow_vllm_logging(module=None) -> bool:
    """Route ``kvcached_pd`` through vLLM's logging; True if this call changed anything."""
    ours = logging.getLogger(LOGGER_NAME)
    if ours.handlers or ours.level != logging.NOTSET:
        return False  # configured already: by the operator, or by an earlier call
    ours.__class__ = _FollowsVllmLevel
    ours.addHandler(ToVllmLogger())
    ours.propagate = False  # vLLM's own loggers do not propagate either: no duplicates
    logging.getLogger().manager._clear_cache()  # levels cached under the old class
    # vLLM 0.31+: the held lines go out as soon as vLLM configures logging, in the
    # function every configure path of 0.31-0.33 ends in (absent elsewhere: then they
    # go out with the next line kvcached-pd logs)
    target = getattr(module, "_configure_vllm_root_logger", None)
    if callable(target) and not getattr(target, "__kvcached_pd_release__", False):
        module._configure_vllm_root_logger = _release_after(target)
    return True
