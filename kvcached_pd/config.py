"""Every environment variable kvcached-pd reads, declared once, parsed once per process.

``VARIABLES`` is the one list: name, default, parser and meaning of each variable. The
doctor prints it, the README's table is checked against it (tests/test_operator_docs.py)
and the test suite clears it between tests. :func:`settings` parses it once per process
and every consumer (activation, the connector guard, the patches) reads that object,
the way OpenTelemetry's instrumentors close over a configuration parsed once.

kvcached's own switches are parsed exactly as kvcached 0.1.6 parses them (``"1"`` and
``"true"``, any case, no whitespace stripped; tests/test_settings.py compares both on
the same inputs): kvcached-pd must agree with kvcached about whether kvcached is on and
which layout it builds, or it guards the wrong configuration.

This module is imported by ``sitecustomize`` and the vLLM plugin in every Python
process, so it stays cheap: the standard library only, no vLLM, torch or wrapt.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ENABLE_KVCACHED = "ENABLE_KVCACHED"  # kvcached's own switch
KVCACHED_AUTOPATCH = "KVCACHED_AUTOPATCH"  # kvcached's own switch
KVCACHED_CONTIGUOUS_LAYOUT = "KVCACHED_CONTIGUOUS_LAYOUT"  # kvcached's layout switch
KVCACHED_PD = "KVCACHED_PD"  # force kvcached-pd on (1) or off (0); default: follow kvcached
KVCACHED_PD_DISABLE = "KVCACHED_PD_DISABLE"  # comma-separated patch names to leave out
KVCACHED_PD_STRICT = "KVCACHED_PD_STRICT"  # re-raise errors of import hooks (tests)
KVCACHED_PD_TRANSPORT = "KVCACHED_PD_TRANSPORT"  # staged | direct
KVCACHED_PD_STAGING_MB = "KVCACHED_PD_STAGING_MB"  # staging region per worker
KVCACHED_PD_READ_SPIN_US = "KVCACHED_PD_READ_SPIN_US"  # D: wait this long for a READ about to end
KVCACHED_PD_PACK_KERNEL = "KVCACHED_PD_PACK_KERNEL"  # auto | graph | triton | torch
KVCACHED_PD_WIRE = "KVCACHED_PD_WIRE"  # auto | nixl | ipc: how a staged extent reaches D
KVCACHED_PD_TRACE = "KVCACHED_PD_TRACE"  # log one timestamped line per handoff event
KVCACHED_PD_TEST_CORRUPT = "KVCACHED_PD_TEST_CORRUPT"  # test-only negative control
KVCACHED_PD_STATE_DIR = "KVCACHED_PD_STATE_DIR"  # where processes publish registrations
KVCACHED_PD_SIDE_CHANNEL_PORT = "KVCACHED_PD_SIDE_CHANNEL_PORT"  # P's staged handshake port
# a file holding the secret P's listener asks D to prove (connector/side_channel.py)
KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE = "KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE"
VLLM_KV_CACHE_LAYOUT = "VLLM_KV_CACHE_LAYOUT"  # vLLM's own; head-major values are refused

TRANSPORTS = ("staged", "direct")
PACK_KERNELS = ("auto", "graph", "triton", "torch")  # auto: graphs once proven on the device
# How D takes a staged extent from P: "ipc" maps P's staging through CUDA IPC and unpacks
# straight from it (same host: 1.5 TB/s on one H100, where NIXL/UCX between two
# processes on one GPU moves 0.5 GB/s); "nixl" READs it into D's staging; "auto" picks
# IPC per peer whenever D can open P's staging, NIXL otherwise.
WIRES = ("auto", "nixl", "ipc")
# Staged by default when kvcached backs the cache (kvcached memory is never a NIXL
# remote then); direct, i.e. vLLM's own data path, for plain vLLM unless asked.
DEFAULT_TRANSPORT_WITH_KVCACHED = "staged"
DEFAULT_TRANSPORT = "direct"
DEFAULT_STAGING_MB = None  # unset: sized from the engine (kvcached_pd.transport.sizing)
# Extents of the staging region start on this boundary (bytes): a page, so NIXL
# descriptors and the pack kernels' 8-byte words never straddle one.
STAGING_ALIGNMENT = 4096
# The decode side polls its staged READs once per engine step. A READ predicted to end
# within this budget is waited for in the same step, saving a whole engine step of
# latency for at most this much blocking. 0 turns it off.
DEFAULT_READ_SPIN_US = 1000
MAX_READ_SPIN_US = 20000
# A side-channel secret of fewer bytes is refused: 16 random bytes (32 hex digits) are
# the 128 bits an HMAC key should have; the file is read whole, so it is capped too.
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
BOOLEAN_VALUES = "1/true/yes/on or 0/false/no/off"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in _TRUE


# -- kvcached's own switches, exactly as kvcached 0.1.6 reads them -----------------------
def _kvcached_bool(value: str | None) -> bool:
    """kvcached's ``os.getenv(name, "false").lower() in ("true", "1")``."""
    return (value if value is not None else "false").lower() in ("true", "1")


def kvcached_enabled(env: Mapping[str, str] | None = None) -> bool:
    """True when kvcached backs vLLM's KV cache (``kvcached.integration.patch_base``)."""
    env = os.environ if env is None else env
    return _kvcached_bool(env.get(ENABLE_KVCACHED))


def kvcached_autopatch(env: Mapping[str, str] | None = None) -> bool:
    """Whether kvcached's autopatch runs when vLLM is imported.

    kvcached's ``kvcached_autopatch.pth`` does ``setdefault("KVCACHED_AUTOPATCH", "1")``
    when ``ENABLE_KVCACHED`` is on, then its vLLM autopatch reads ``KVCACHED_AUTOPATCH``;
    so ``ENABLE_KVCACHED=true`` alone turns kvcached's patches on.
    """
    env = os.environ if env is None else env
    value = env.get(KVCACHED_AUTOPATCH)
    if value is None and kvcached_enabled(env):
        value = "1"
    return _kvcached_bool(value)


def kvcached_contiguous_layout(env: Mapping[str, str] | None = None) -> bool:
    """``kvcached.utils._default_contiguous_layout``: an explicit value is true only when
    it reads ``true`` (``"1"`` is false); unset, contiguous except on ROCm."""
    env = os.environ if env is None else env
    explicit = env.get(KVCACHED_CONTIGUOUS_LAYOUT)
    if explicit is not None:
        return explicit.lower() == "true"
    torch = sys.modules.get("torch")  # never imported here; ROCm is outside NIXL's path
    return not getattr(getattr(torch, "version", None), "hip", None)


# -- the gate ---------------------------------------------------------------------------
def _forced(env: Mapping[str, str]) -> str | None:
    """``KVCACHED_PD`` as "on", "off", "unknown", or None when unset/empty."""
    raw = env.get(KVCACHED_PD)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    return "on" if value in _TRUE else "off" if value in _FALSE else "unknown"


def gate_open(env: Mapping[str, str] | None = None) -> bool:
    """Whether kvcached-pd activates in this process.

    On when kvcached's own activation is on (``ENABLE_KVCACHED`` and its autopatch, read
    as kvcached reads them), unless ``KVCACHED_PD=0``; ``KVCACHED_PD=1`` turns it on
    without kvcached (the staged transport also serves plain vLLM). An unrecognised
    ``KVCACHED_PD`` opens the gate too, so that the connector guard is armed to refuse
    it: silently reading it as "off" would hand NIXL to kvcached's own patch.
    """
    env = os.environ if env is None else env
    forced = _forced(env)
    if forced is not None:
        return forced != "off"
    return kvcached_enabled(env) and kvcached_autopatch(env)


def gate_reason(env: Mapping[str, str] | None = None) -> str:
    """One sentence saying why the gate is open or closed, for the doctor and the log."""
    env = os.environ if env is None else env
    forced = _forced(env)
    if forced == "off":
        return (f"{KVCACHED_PD}={env[KVCACHED_PD]!r} turns kvcached-pd off"
                + ("; kvcached's own NIXL patch applies" if kvcached_enabled(env) else ""))
    if forced == "on":
        return f"{KVCACHED_PD}={env[KVCACHED_PD]!r} turns kvcached-pd on"
    if forced == "unknown":
        return (f"{KVCACHED_PD}={env[KVCACHED_PD]!r} is not a recognised value; "
                "kvcached-pd arms its guard to refuse NIXL startup")
    if kvcached_enabled(env) and kvcached_autopatch(env):
        return f"kvcached is on ({ENABLE_KVCACHED}, {KVCACHED_AUTOPATCH})"
    if not kvcached_enabled(env):
        return (f"kvcached is off ({ENABLE_KVCACHED}={env.get(ENABLE_KVCACHED, '')!r}; kvcached "
                "reads only 'true' or '1') and KVCACHED_PD is unset")
    return f"kvcached's autopatch is off ({KVCACHED_AUTOPATCH}={env.get(KVCACHED_AUTOPATCH)!r})"


# -- the declared variables --------------------------------------------------------------
Parsed = tuple[Any, "str | None"]  # (value, problem)


def _parse_bool(name: str) -> Callable[[str | None, Mapping[str, str]], Parsed]:
    def parse(raw: str | None, env: Mapping[str, str]) -> Parsed:
        if raw is not None and raw.strip().lower() not in _TRUE + _FALSE:
            return False, f"{name}={raw!r} must be {BOOLEAN_VALUES}"
        return _truthy(raw), None
    return parse


def _parse_kvcached_pd(raw: str | None, env: Mapping[str, str]) -> Parsed:
    forced = _forced(env)
    if forced == "unknown":
        return None, (f"{KVCACHED_PD}={raw!r} is not a recognised value: use 1 (on), 0 (off; "
                      "kvcached's own NIXL patch then applies) or leave it unset (follow "
                      f"{ENABLE_KVCACHED})")
    return {"on": True, "off": False}.get(forced or ""), None


def _parse_disable(raw: str | None, env: Mapping[str, str]) -> Parsed:
    names = frozenset(n.strip() for n in (raw or "").split(",") if n.strip())
    return names, None  # checked against the patch table by checks.setting_problems


def _parse_transport(raw: str | None, env: Mapping[str, str]) -> Parsed:
    default = DEFAULT_TRANSPORT_WITH_KVCACHED if kvcached_enabled(env) else DEFAULT_TRANSPORT
    value = (raw or default).strip().lower()
    if value not in TRANSPORTS:
        return default, f"{KVCACHED_PD_TRANSPORT}={value!r} is not one of {list(TRANSPORTS)}"
    return value, None


def _ascii_int(text: str, max_digits: int = 9) -> int | None:
    """``text`` as a non-negative integer, or None. ASCII digits only: ``int`` also
    reads "١٢" and "1_0" and raises on "²" (which ``str.isdigit`` accepts), and a value
    has a few digits, not the thousands ``int`` would try."""
    if not (0 < len(text) <= max_digits and text.isascii() and text.isdigit()):
        return None
    return int(text)


def _parse_staging_mb(raw: str | None, env: Mapping[str, str]) -> Parsed:
    text = (raw or "").strip()
    if not text:
        return DEFAULT_STAGING_MB, None  # the engine-derived default
    value = _ascii_int(text) or 0
    if value <= 0:
        return DEFAULT_STAGING_MB, (f"{KVCACHED_PD_STAGING_MB}={text!r} must be a positive "
                                    "integer (MiB), or unset for the default size")
    return value, None


def _parse_read_spin(raw: str | None, env: Mapping[str, str]) -> Parsed:
    text = (raw if raw is not None else str(DEFAULT_READ_SPIN_US)).strip()
    value = _ascii_int(text)
    if value is None or not 0 <= value <= MAX_READ_SPIN_US:
        return DEFAULT_READ_SPIN_US, (f"{KVCACHED_PD_READ_SPIN_US}={text!r} must be an integer "
                                      f"from 0 (off) to {MAX_READ_SPIN_US} (microseconds)")
    return value, None


def _parse_side_channel_port(raw: str | None, env: Mapping[str, str]) -> Parsed:
    text = (raw or "0").strip()
    value = _ascii_int(text, max_digits=5)
    if value is None or not 0 <= value <= 65535:
        return 0, (f"{KVCACHED_PD_SIDE_CHANNEL_PORT}={text!r} must be a TCP port number "
                   "(1-65535), or 0 for any free port")
    return value, None


def _parse_side_channel_secret(raw: str | None, env: Mapping[str, str]) -> Parsed:
    """The secret's bytes (surrounding whitespace stripped), read once, before the model
    loads, so that a missing or short file stops startup rather than the first handshake."""
    path = (raw or "").strip()
    if not path:
        return None, None
    name = KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block the read
        return None, f"{name}={path!r} is not a regular file"
    try:
        with open(path, "rb") as f:
            secret = f.read(MAX_SECRET_BYTES + 1).strip()
    except OSError as exc:
        return None, f"{name}={path!r} cannot be read: {exc.strerror or exc}"
    if len(secret) > MAX_SECRET_BYTES:
        return None, f"{name}={path!r} holds more than {MAX_SECRET_BYTES} bytes; is it a secret?"
    if len(secret) < MIN_SECRET_BYTES:
        return None, (f"{name}={path!r} holds {len(secret)} bytes; a secret needs at least "
                      f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32 > FILE`)")
    return secret, None


def _parse_wire(raw: str | None, env: Mapping[str, str]) -> Parsed:
    value = (raw or "auto").strip().lower()
    if value not in WIRES:
        return "auto", (f"{KVCACHED_PD_WIRE}={value!r} is not one of {list(WIRES)} (auto: CUDA "
                        "IPC for a peer on this host whose staging this process can open, "
                        "NIXL otherwise)")
    return value, None


def _parse_pack_kernel(raw: str | None, env: Mapping[str, str]) -> Parsed:
    value = (raw or "auto").strip().lower()
    if value not in PACK_KERNELS:
        return "auto", f"{KVCACHED_PD_PACK_KERNEL}={value!r} is not one of {list(PACK_KERNELS)}"
    return value, None


def state_dir(env: Mapping[str, str] | None = None) -> str:
    """Where running processes publish their registrations for the doctor."""
    env = os.environ if env is None else env
    return env.get(KVCACHED_PD_STATE_DIR) or os.path.join(
        tempfile.gettempdir(), f"kvcached-pd-{os.getuid()}")


def _parse_state_dir(raw: str | None, env: Mapping[str, str]) -> Parsed:
    return state_dir(env), None


def _parse_kvcached_switch(reader: Callable[[Mapping[str, str]], bool]):
    return lambda raw, env: (reader(env), None)


def _parse_vllm_layout(raw: str | None, env: Mapping[str, str]) -> Parsed:
    return (raw or "").strip().upper(), None  # checked by checks.layout_problems


@dataclass(frozen=True)
class Variable:
    """One environment variable: what it is called, its default as an operator reads it,
    how it is parsed (``parse(raw, env) -> (value, problem or None)``) and what it means."""

    name: str
    default: str
    meaning: str
    parse: Callable[[str | None, Mapping[str, str]], Parsed]
    field: str  # the Settings attribute it fills
    owner: str = "kvcached-pd"  # or "kvcached", "vLLM": whose variable it is


VARIABLES: tuple[Variable, ...] = (
    Variable(ENABLE_KVCACHED, "off", "kvcached's switch (kvcached reads only `true`/`1`); "
             "with kvcached's autopatch it opens kvcached-pd's gate",
             _parse_kvcached_switch(kvcached_enabled), "kvcached_enabled", owner="kvcached"),
    Variable(KVCACHED_AUTOPATCH, "on when `ENABLE_KVCACHED` is", "kvcached's autopatch "
             "(its `.pth` defaults it to `1` when `ENABLE_KVCACHED` is on)",
             _parse_kvcached_switch(kvcached_autopatch), "kvcached_autopatch", owner="kvcached"),
    Variable(KVCACHED_CONTIGUOUS_LAYOUT, "`true` (kvcached's)", "kvcached's layout; only "
             "`true` reads as true (`1` is false); checked against the transport (blocking "
             "problems below)",
             _parse_kvcached_switch(kvcached_contiguous_layout), "kvcached_contiguous_layout",
             owner="kvcached"),
    Variable(KVCACHED_PD, "follow kvcached", "`0`: kvcached-pd off (kvcached's own NIXL patch "
             "then applies); `1`: on, also without kvcached; any other value stops startup",
             _parse_kvcached_pd, "forced"),
    Variable(KVCACHED_PD_DISABLE, "empty", "comma-separated patch names to leave out "
             "(`kvcached-pd doctor` lists them); unknown names stop startup; "
             "`connector_guard` cannot waive a blocking problem; `connector_routing` leaves "
             "vLLM's NIXL connector names to vLLM's own connectors (per-block descriptors: "
             "an explicit `KVCACHED_PD_TRANSPORT=staged`, or kvcached's contiguous layout, "
             "then stops startup)",
             _parse_disable, "disabled_patches"),
    Variable(KVCACHED_PD_TRANSPORT, "`staged` with kvcached, else `direct`", "`staged`: the "
             "staged transport, kvcached-pd's connector (pull: vLLM 0.20-0.33; push: 0.24-0.33; "
             "asked for explicitly where it cannot serve, startup stops); `direct`: vLLM's own per-block descriptors over the physical budget",
             _parse_transport, "transport"),
    Variable(KVCACHED_PD_STAGING_MB, "sized from the engine", "MiB of staging per role "
             "(prefill, decode; a `kv_both` instance has both) of each worker, ordinary device "
             "memory registered with NIXL (the decode range at the first READ over NIXL, never "
             "on the CUDA IPC wire; at start-up with `KVCACHED_PD_WIRE=nixl`). Unset: min(KV budget, max(2 x one max_model_len "
             "request, 2 x max_num_batched_tokens, 2 GiB)) of KV. A full staging makes "
             "requests wait, never take the direct path; a size that cannot hold one "
             "max_model_len request, or more than the device's free memory, stops startup",
             _parse_staging_mb, "staging_mb"),
    Variable(KVCACHED_PD_PACK_KERNEL, "auto", "pack/unpack kernels: `auto` replays one "
             "Triton kernel for all layers as a CUDA graph (one graph launch a request "
             "instead of three to five operations) once a self-check on the device matched "
             "the torch path, else "
             "one Triton launch for all layers (when the layers do not share one storage "
             "and its own self-check passed), else torch index ops; `graph` and `triton` "
             "require theirs (startup stops if it cannot be used); `torch` uses neither",
             _parse_pack_kernel, "pack_kernel"),
    Variable(KVCACHED_PD_WIRE, "auto", "decode side: how a staged extent reaches D. `auto`: "
             "per peer, CUDA IPC when P is on this host and D can open P's staging (same GPU, "
             "or a GPU it can peer with; containers need a shared IPC namespace, e.g. "
             "`--ipc=host`), NIXL otherwise, logged once per peer; `nixl`: always a NIXL READ "
             "into D's staging (allocated at start-up; otherwise at the first READ over "
             "NIXL); `ipc`: CUDA IPC only (a peer it cannot open fails its "
             "requests' loads, never takes NIXL)", _parse_wire, "wire"),
    Variable(KVCACHED_PD_READ_SPIN_US, str(DEFAULT_READ_SPIN_US), "decode side: wait up to this "
             "long, within one engine step, for a staged READ predicted to end inside it; `0` "
             f"leaves polling to vLLM; at most {MAX_READ_SPIN_US}",
             _parse_read_spin, "read_spin_us"),
    Variable(KVCACHED_PD_SIDE_CHANNEL_PORT, "unset: any free port (pull), vLLM's NIXL "
             "side-channel port + 1000 (push)", "prefill side: TCP port of the "
             "staged transport's handshake listener (one per engine, on vLLM's "
             "`VLLM_NIXL_SIDE_CHANNEL_HOST`); its port travels to D in each request's "
             "params, so set it only where a firewall needs a fixed port; in push mode a "
             "decode leg sent before P answered finds it only at vLLM's port + 1000",
             _parse_side_channel_port, "side_channel_port"),
    Variable(KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE, "unset: no authentication", "a file "
             "holding a shared secret (at least 16 bytes, e.g. `openssl rand -hex 32`; keep it "
             "mode 0600) for the staged transport's listener: a prefill with it answers only "
             "handshakes and claims that prove it (HMAC-SHA256), a decode with it proves it; "
             "give it to every instance, the decode instances first (a prefill without it "
             "accepts proven requests too). A missing, unreadable or shorter file stops "
             "startup. See \"Trust model\" below",
             _parse_side_channel_secret, "side_channel_secret"),
    Variable(KVCACHED_PD_TRACE, "off", "log one `kvcached-pd trace {json}` line per handoff "
             "event and per engine step that computed tokens (both sides); "
             "`experiments/trace_timeline.py LOG_DIR` turns them into per-stage timelines",
             _parse_bool(KVCACHED_PD_TRACE), "trace"),
    Variable(KVCACHED_PD_STRICT, "off", "re-raise errors inside import hooks (tests)",
             _parse_bool(KVCACHED_PD_STRICT), "strict"),
    Variable(KVCACHED_PD_TEST_CORRUPT, "off", "TEST ONLY: D negates the first received block "
             "(the harness's negative control; `kvcached_pd/testing/`)",
             _parse_bool(KVCACHED_PD_TEST_CORRUPT), "test_corrupt"),
    Variable(KVCACHED_PD_STATE_DIR, "`$TMPDIR/kvcached-pd-$UID`", "where running processes "
             "publish their registrations for the doctor; created mode 0700; one that is not "
             "this user's own (another owner, a link, writable by others) is neither written "
             "nor read", _parse_state_dir, "state_dir"),
    Variable(VLLM_KV_CACHE_LAYOUT, "unset (vLLM's)", "vLLM's layout override; `HND`/`LBHNC` "
             "stop startup with kvcached", _parse_vllm_layout, "vllm_kv_cache_layout",
             owner="vLLM"),
)

VARIABLE_NAMES: tuple[str, ...] = tuple(v.name for v in VARIABLES)


@dataclass(frozen=True)
class Settings:
    """The parsed settings of one process, with the problems found while parsing them.

    ``problems`` block a NIXL startup while kvcached-pd is active; with the gate closed
    nothing reads them (the doctor lists them as ignored). ``checks.setting_problems``
    reports them together with names in ``disabled_patches`` that no patch has (it is
    handed the patch table; this module knows none of it).
    """

    disabled_patches: frozenset[str] = frozenset()
    strict: bool = False
    transport: str = DEFAULT_TRANSPORT
    staging_mb: int | None = DEFAULT_STAGING_MB
    read_spin_us: int = DEFAULT_READ_SPIN_US
    side_channel_port: int = 0
    side_channel_secret: bytes | None = field(default=None, repr=False)  # never printed
    pack_kernel: str = "auto"
    wire: str = "auto"
    trace: bool = False
    test_corrupt: bool = False
    problems: tuple[str, ...] = field(default_factory=tuple)
    # added with the declared list
    active: bool = False  # the gate (gate_open)
    gate_reason: str = ""
    forced: bool | None = None  # KVCACHED_PD: True/False, None when unset or unrecognised
    kvcached_enabled: bool = False
    kvcached_autopatch: bool = False
    kvcached_contiguous_layout: bool = True
    transport_explicit: bool = False  # KVCACHED_PD_TRANSPORT was set, not defaulted
    state_dir: str = ""
    vllm_kv_cache_layout: str = ""

    @property
    def staging_bytes(self) -> int | None:
        """Bytes of one role's staging when set explicitly; None: sized from the engine."""
        return None if self.staging_mb is None else self.staging_mb << 20


def read_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Parse every declared variable of ``env``; bad values become problems, not guesses.

    Pure: tests call it with a dict. A process reads its own environment once, through
    :func:`settings`. ``KVCACHED_PD_DISABLE``'s names are checked against the patch
    table where that table is known (:func:`kvcached_pd.checks.setting_problems`):
    this module is the lowest layer and imports nothing of kvcached-pd.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    problems: list[str] = []
    for var in VARIABLES:
        value, problem = var.parse(env.get(var.name), env)
        values[var.field] = value
        if problem:
            problems.append(problem)
    return Settings(
        **values,
        problems=tuple(problems),
        active=gate_open(env),
        gate_reason=gate_reason(env),
        transport_explicit=bool((env.get(KVCACHED_PD_TRANSPORT) or "").strip()),
    )


_lock = threading.Lock()
_settings: Settings | None = None


def settings() -> Settings:
    """This process's settings, parsed from ``os.environ`` on first use and kept.

    Activation, the connector guard, the doctor and the patches all read this one
    object, so a value cannot mean one thing to one of them and another to the next.
    """
    global _settings
    with _lock:
        if _settings is None:
            _settings = read_settings()
        return _settings


def reset_settings_for_tests() -> None:
    """Forget the parsed settings so the next :func:`settings` re-reads the environment."""
    global _settings
    with _lock:
        _settings = None
