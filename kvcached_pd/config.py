"""Environment settings of kvcached-pd, read without importing anything heavy.

This module is imported by ``sitecustomize`` and by the vLLM plugin entry point in
every Python process, so it must stay cheap: the standard library only, no vLLM,
torch or wrapt. Everything an operator can set lives here, with its default, so
that the README, the doctor and the code agree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

ENABLE_KVCACHED = "ENABLE_KVCACHED"  # kvcached's own switch
KVCACHED_AUTOPATCH = "KVCACHED_AUTOPATCH"  # kvcached's own switch
KVCACHED_CONTIGUOUS_LAYOUT = "KVCACHED_CONTIGUOUS_LAYOUT"  # kvcached's layout switch
KVCACHED_PD = "KVCACHED_PD"  # force kvcached-pd on (1) or off (0); default: follow kvcached
KVCACHED_PD_DISABLE = "KVCACHED_PD_DISABLE"  # comma-separated patch names to leave out
KVCACHED_PD_STRICT = "KVCACHED_PD_STRICT"  # re-raise errors of import hooks (tests)
KVCACHED_PD_TRANSPORT = "KVCACHED_PD_TRANSPORT"  # staged | direct
KVCACHED_PD_STAGING_MB = "KVCACHED_PD_STAGING_MB"  # staging region per worker
KVCACHED_PD_READ_SPIN_US = "KVCACHED_PD_READ_SPIN_US"  # D: wait this long for a READ about to end
KVCACHED_PD_PACK_KERNEL = "KVCACHED_PD_PACK_KERNEL"  # auto | triton | torch
KVCACHED_PD_TRACE = "KVCACHED_PD_TRACE"  # log one timestamped line per handoff event
KVCACHED_PD_TEST_CORRUPT = "KVCACHED_PD_TEST_CORRUPT"  # test-only negative control

TRANSPORTS = ("staged", "direct")
PACK_KERNELS = ("auto", "triton", "torch")  # auto: Triton once proven on the device
# Staged by default when kvcached backs the cache (kvcached memory is never a NIXL
# remote then); direct, i.e. vLLM's own data path, for plain vLLM unless asked.
DEFAULT_TRANSPORT_WITH_KVCACHED = "staged"
DEFAULT_TRANSPORT = "direct"
DEFAULT_STAGING_MB = None  # sized from the engine (kvcached_pd.transport.sizing)
# The decode side polls its staged READs once per engine step. A READ predicted to end
# within this budget is waited for in the same step, saving a whole engine step of
# latency for at most this much blocking. 0 turns it off.
DEFAULT_READ_SPIN_US = 1000
MAX_READ_SPIN_US = 20000

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in _TRUE


def kvcached_enabled(env: Mapping[str, str] | None = None) -> bool:
    """True when kvcached backs vLLM's KV cache in this process (its own gate)."""
    env = os.environ if env is None else env
    return _truthy(env.get(ENABLE_KVCACHED))


def kvcached_contiguous_layout(env: Mapping[str, str] | None = None) -> bool:
    """kvcached's default is the contiguous (layer-interleaved) layout."""
    env = os.environ if env is None else env
    return (env.get(KVCACHED_CONTIGUOUS_LAYOUT, "true").strip().lower()) in _TRUE


def gate_open(env: Mapping[str, str] | None = None) -> bool:
    """Whether kvcached-pd activates in this process.

    On when kvcached's own activation is on (``ENABLE_KVCACHED=true`` and
    ``KVCACHED_AUTOPATCH=1``), unless ``KVCACHED_PD=0``; ``KVCACHED_PD=1`` turns it on
    without kvcached (the staged transport also serves plain vLLM).
    """
    env = os.environ if env is None else env
    forced = env.get(KVCACHED_PD)
    if forced is not None and forced.strip() != "":
        return _truthy(forced)
    return _truthy(env.get(ENABLE_KVCACHED)) and _truthy(env.get(KVCACHED_AUTOPATCH))


@dataclass(frozen=True)
class Settings:
    """The parsed settings, with the problems found while parsing them."""

    disabled_patches: frozenset[str] = frozenset()
    strict: bool = False
    transport: str = DEFAULT_TRANSPORT
    staging_mb: int | None = DEFAULT_STAGING_MB
    read_spin_us: int = DEFAULT_READ_SPIN_US
    pack_kernel: str = "auto"
    trace: bool = False
    test_corrupt: bool = False
    problems: tuple[str, ...] = field(default_factory=tuple)


def read_settings(
    known_patches: frozenset[str], env: Mapping[str, str] | None = None
) -> Settings:
    """Parse the KVCACHED_PD_* variables; bad values become problems, not guesses."""
    env = os.environ if env is None else env
    problems: list[str] = []

    disabled = frozenset(
        name.strip() for name in env.get(KVCACHED_PD_DISABLE, "").split(",") if name.strip()
    )
    unknown = sorted(disabled - known_patches)
    if unknown:
        problems.append(
            f"{KVCACHED_PD_DISABLE} names unknown patch(es) {unknown}; "
            f"known patches: {sorted(known_patches)}"
        )

    default = DEFAULT_TRANSPORT_WITH_KVCACHED if kvcached_enabled(env) else DEFAULT_TRANSPORT
    transport = (env.get(KVCACHED_PD_TRANSPORT) or default).strip().lower()
    if transport not in TRANSPORTS:
        problems.append(
            f"{KVCACHED_PD_TRANSPORT}={transport!r} is not one of {list(TRANSPORTS)}"
        )
        transport = default

    raw_mb = (env.get(KVCACHED_PD_STAGING_MB) or "").strip()
    staging_mb = DEFAULT_STAGING_MB
    if raw_mb:
        try:
            staging_mb = int(raw_mb)
            if staging_mb <= 0:
                raise ValueError
        except ValueError:
            problems.append(f"{KVCACHED_PD_STAGING_MB}={raw_mb!r} must be a positive integer "
                            "(MiB), or unset for the default size")
            staging_mb = DEFAULT_STAGING_MB

    raw_spin = env.get(KVCACHED_PD_READ_SPIN_US, str(DEFAULT_READ_SPIN_US)).strip()
    try:
        read_spin_us = int(raw_spin)
        if not 0 <= read_spin_us <= MAX_READ_SPIN_US:
            raise ValueError
    except ValueError:
        problems.append(f"{KVCACHED_PD_READ_SPIN_US}={raw_spin!r} must be an integer from 0 "
                        f"(off) to {MAX_READ_SPIN_US} (microseconds)")
        read_spin_us = DEFAULT_READ_SPIN_US

    pack_kernel = (env.get(KVCACHED_PD_PACK_KERNEL) or "auto").strip().lower()
    if pack_kernel not in PACK_KERNELS:
        problems.append(f"{KVCACHED_PD_PACK_KERNEL}={pack_kernel!r} is not one of {list(PACK_KERNELS)}")
        pack_kernel = "auto"

    for name in (KVCACHED_PD_STRICT, KVCACHED_PD_TRACE, KVCACHED_PD_TEST_CORRUPT):
        value = env.get(name)
        if value is not None and value.strip().lower() not in _TRUE + _FALSE:
            problems.append(f"{name}={value!r} must be 0/1 or true/false")

    return Settings(
        disabled_patches=disabled,
        strict=_truthy(env.get(KVCACHED_PD_STRICT)),
        transport=transport,
        staging_mb=staging_mb,
        read_spin_us=read_spin_us,
        pack_kernel=pack_kernel,
        trace=_truthy(env.get(KVCACHED_PD_TRACE)),
        test_corrupt=_truthy(env.get(KVCACHED_PD_TEST_CORRUPT)),
        problems=tuple(problems),
    )
