"""Test-only patches: never in the product's patch table (``kvcached_pd.patches``).

Each is armed by activation only when its own variable is set, and is not listed by
``KVCACHED_PD_DISABLE`` or the doctor's patch table. ``ARMED_BY`` maps each to the
Settings field that arms it.
"""

from __future__ import annotations

from kvcached_pd.testing.corrupt_received_kv import CorruptReceivedKVPatch

TEST_PATCHES = (CorruptReceivedKVPatch(),)
ARMED_BY = {CorruptReceivedKVPatch.name: "test_corrupt"}


def armed(settings) -> tuple:
    """The test-only patches whose variable is set in ``settings``."""
    return tuple(p for p in TEST_PATCHES if getattr(settings, ARMED_BY[p.name]))
