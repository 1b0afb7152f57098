"""The side-channel ports the in-process PD tests give their engines: reserved across the
test processes the test command runs side by side, so that no two engines bind one port
(vLLM's handshake listener thread dies on a taken port, and its engine's start then
waits forever)."""

from __future__ import annotations

import errno
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import types

import pytest

from kvcached_pd.connector.side_channel import claim_port
from tests import conftest
from tests.support import connector_pd
from tests.support.dead_ports import dead_ports


def test_ports_never_meet_claim_ports_and_stay_below_the_ephemeral_range():
    ports = connector_pd._side_channel_ports(32768)
    chosen = set(ports)
    assert len(ports) >= 4000
    assert all(1024 <= p and claim_port(p) < 32768 for p in ports)
    assert not chosen & {claim_port(p) for p in ports}


def test_a_port_another_process_holds_is_not_chosen(monkeypatch):
    ports = connector_pd._side_channel_ports(32768)
    held, other = ports[0], ports[1]
    os.makedirs(connector_pd.PORT_LOCK_DIR, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, sys
            fd = os.open({os.path.join(connector_pd.PORT_LOCK_DIR, str(held))!r},
                         os.O_CREAT | os.O_RDWR, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)
            print("held", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        draws = iter([held, held, other])
        monkeypatch.setattr(random, "choice", lambda seq: next(draws))
        monkeypatch.setattr(connector_pd, "_held_ports", {})
        port = connector_pd._free_port()
        assert port == other
        # held for this process now: a second process's lock on it fails
        fd = os.open(os.path.join(connector_pd.PORT_LOCK_DIR, str(other)), os.O_RDWR)
        try:
            probe = subprocess.run(
                [sys.executable, "-c", textwrap.dedent(f"""
                    import fcntl, os
                    fd = os.open({os.path.join(connector_pd.PORT_LOCK_DIR, str(other))!r},
                                 os.O_RDWR)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        print("got it")
                    except OSError:
                        print("refused")
                """)], capture_output=True, text=True, check=True)
            assert probe.stdout.strip() == "refused"
        finally:
            os.close(fd)
        connector_pd._release_port(port)
        assert port not in connector_pd._held_ports
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_dead_ports_refuse_connections_and_cannot_be_taken_until_released():
    """What the tests' dead targets rely on (``tests/support/dead_ports.py``): while held,
    a connection is refused and a listener that asks for address reuse still cannot bind
    the port; released, it can."""
    with dead_ports(3) as ports:
        assert len(set(ports)) == 3
        for port in ports:
            with socket.socket() as client:
                with pytest.raises(ConnectionRefusedError):
                    client.connect(("127.0.0.1", port))
            with socket.socket() as thief:
                thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError) as taken:
                    thief.bind(("127.0.0.1", port))
                assert taken.value.errno == errno.EADDRINUSE
    with socket.socket() as after:
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", ports[0]))


def test_a_failing_tests_report_shows_each_live_threads_stack():
    """The conftest hook adds the live threads' stacks to a failed call's report, and to
    nothing else: a thread blocked in a function of its own is named with that function."""
    release = threading.Event()

    def held_by_the_test_of_thread_stacks():
        release.wait(30)

    worker = threading.Thread(target=held_by_the_test_of_thread_stacks, name="held-thread")
    worker.start()
    try:
        reports = {}
        for when, failed in (("call", True), ("call", False), ("setup", True)):
            report = types.SimpleNamespace(when=when, failed=failed, sections=[])
            hook = conftest.pytest_runtest_makereport(None, None)
            next(hook)
            try:
                hook.send(types.SimpleNamespace(get_result=lambda report=report: report))
            except StopIteration:
                pass
            reports[(when, failed)] = report.sections
    finally:
        release.set()
        worker.join()
    (title, text), = reports[("call", True)]
    assert title == "live threads at the failure"
    assert "'held-thread'" in text and "held_by_the_test_of_thread_stacks" in text
    assert reports[("call", False)] == [] and reports[("setup", True)] == []
