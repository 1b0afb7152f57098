"""NIXL agents in the test process poll with a 1 ms pause instead of spinning.

NIXL's Python API builds every agent with a progress thread whose delay is hard-wired to
0 (``nixl._api.nixl_agent``: ``pthrDelay = 0``): the thread busy-polls UCX, one core per
agent, until the agent is destroyed or the process ends. A P/D pair has two or more
agents; on CI's 2 cores those threads starved everything else (measured here: two idle
agents used 1.76 CPU-s in 5 s of wall time with the delay at 0 under load, 0.09 CPU-s
with 1000 us). Progress is still made by the same thread, only not more often than every
millisecond, and by every call that checks a transfer or reads notifications, as before;
what the tests check (which bytes move, when DONE arrives relative to the unpack, what is
freed) does not depend on how eagerly UCX is polled.

Armed once from ``tests/conftest.py`` for agents built in the pytest process, as a
post-import hook: importing NIXL early would change what vLLM does (it sets
``UCX_RCACHE_MAX_UNRELEASED`` only when NIXL is not imported yet).
"""

from __future__ import annotations

import os

PROGRESS_DELAY_US = 1000
agents_built = 0  # in this process: exit_without_teardown() applies only then


def exit_without_teardown(status: int) -> None:
    """End a test process that built NIXL agents now, with ``status``, without the
    interpreter's and the C++ runtime's teardown.

    At that teardown NIXL/UCX can destroy a thread object still running: "terminate
    called without an active exception" and SIGABRT, after every test had passed (seen
    once in a full run of the test command: vLLM 0.32.0's NIXL group, "131 passed, 16
    skipped", then exit 134; CI's run before it ended the same way on 0.28.0). The
    process has nothing left to do then: the report and the JUnit file are written.
    A crash during a test still ends the run as before."""
    import sys

    if not agents_built:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def arm() -> None:
    """Install :func:`install` for when NIXL is first imported (at once if it is)."""
    import wrapt

    wrapt.register_post_import_hook(lambda _module: install(), "nixl")


def install() -> bool:
    """Wrap NIXL's agent constructor so each new agent's progress thread sleeps
    ``PROGRESS_DELAY_US`` between polls. False where NIXL's bindings are not there."""
    import sys

    try:
        from nixl._api import nixl_agent
    except ImportError:
        return False

    bindings = sys.modules[nixl_agent.__module__].nixlBind
    real = bindings.nixlAgent
    if getattr(real, "_kvcached_pd_quiet", False):
        return True

    def quiet_agent(name, config):
        config.pthrDelay = PROGRESS_DELAY_US
        global agents_built
        agents_built += 1
        return real(name, config)

    quiet_agent._kvcached_pd_quiet = True
    bindings.nixlAgent = quiet_agent
    return True
