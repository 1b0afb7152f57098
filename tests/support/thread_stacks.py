"""Every live thread's stack, for a failing test's report (tests/conftest.py).

The in-process PD tests run P's side-channel listener, the handshake pools, vLLM's
handshake threads and NIXL's callbacks in threads of the test's process. A test that
timed out waiting on one of them said nothing of which one was stuck (2026-11-28, CI on
vLLM 0.32.0: "d-attacker0 never finished" within 30 s, no error logged, not reproduced
in 12 local runs); with the stacks in the report the next such failure says where each
thread was.
"""

from __future__ import annotations

import sys
import threading
import traceback


def thread_stacks() -> str:
    """Each live thread's name, daemon flag and stack, the innermost call last."""
    frames = sys._current_frames()
    out = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        if frame is None:
            continue
        out.append(f"--- thread {thread.name!r} (ident {thread.ident}"
                   f"{', daemon' if thread.daemon else ''})\n"
                   + "".join(traceback.format_stack(frame)))
    return "\n".join(out)
