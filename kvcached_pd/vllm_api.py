"""What kvcached-pd's connector needs from vLLM, per release, in one table.

Every vLLM-specific name the connector, the routing patch, the doctor and the tests
rely on is a field of :class:`VllmApi`; :data:`RELEASES` holds one record per range of
vLLM releases (``packaging`` specifiers, matched against the release number so that
dev builds count as the release they precede). To support a new release: install it,
run the test matrix, and add or widen a record where a name or signature moved.

Everything used is vLLM's public connector interface (``KVConnectorBase_V1``, the
connector factory, ``vllm.envs``, the KV-connector utilities): the connector composes
``NixlConnector`` through its public methods and never touches its private state.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kvcached_pd.versions import VersionRange, installed_version

NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"
CONNECTOR_MODULE = "kvcached_pd.connector"  # kv_connector_module_path, for naming it
CONNECTOR_CLASS = "KvcachedPDConnector"


@dataclass(frozen=True)
class VllmApi:
    """One range of vLLM releases and how they spell what the connector uses."""

    releases: VersionRange  # [minimum, below) over release numbers
    # kv_connector names whose pull-mode NixlConnector the autopatch routes to ours
    pull_names: tuple[str, ...]
    # the push-mode connector (P WRITEs); None where vLLM has none
    push_name: str | None
    # where P's hold on a finished request's blocks ends: "abort_timeout"
    # (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s) or "kv_lease" (kv_lease_duration in the
    # connector's extra config, 30 s by default, renewed by D's heartbeats)
    lease: str
    # the engine core hands the workers' handshakes to the scheduler's connector via
    # this method (keyed by TP rank, or by (PP rank, TP rank))
    handshake_setter: str
    # KVConnectorBase_V1.__init__ takes kv_cache_config (optional before 0.21)
    init_takes_kv_cache_config: str  # "optional" or "required"
    # the module of NIXL_PACKAGE whose logger says P's lease freed a request's blocks
    worker_module: str
    # the NixlKVConnectorStats series a failed NIXL handshake is counted in (0.31 moved
    # it out of num_failed_transfers into its own record_failed_handshake())
    failed_handshake_stat: str = "num_failed_transfers"
    # the oldest NIXL this release's connector starts with (0.33 prepares Nx5 strided
    # descriptor arrays, which nixl's prep_xfer_dlist takes from 1.5 on)
    min_nixl: str = "0.7"

    @property
    def lease_expiry_logger(self) -> str:
        return f"{NIXL_PACKAGE}.{self.worker_module}"

    @property
    def nixl_names(self) -> tuple[str, ...]:
        """Every NIXL connector name of this release kvcached-pd's connector serves."""
        return self.pull_names + ((self.push_name,) if self.push_name else ())

    def contains(self, version: str) -> bool:
        return self.releases.contains(version)


_PULL_PUSH = ("NixlConnector", "NixlPullConnector")
_PUSH = "NixlPushConnector"

RELEASES: tuple[VllmApi, ...] = (
    VllmApi(releases=VersionRange("0.20", "0.23"), pull_names=("NixlConnector",), push_name=None,
            lease="abort_timeout", handshake_setter="set_xfer_handshake_metadata",
            init_takes_kv_cache_config="optional", worker_module="worker"),
    # 0.23.0 (checked; 0.21-0.22 not installed): the abort timeout is gone, P's lease
    # is kv_lease_duration, the engine calls the pp-aware handshake setter
    VllmApi(releases=VersionRange("0.23", "0.24"), pull_names=("NixlConnector",), push_name=None,
            lease="kv_lease", handshake_setter="set_xfer_handshake_metadata_pp_aware",
            init_takes_kv_cache_config="required", worker_module="worker"),
    VllmApi(releases=VersionRange("0.24", "0.26"), pull_names=("NixlConnector", "NixlPullConnector"),
            push_name="NixlPushConnector", lease="kv_lease",
            handshake_setter="set_xfer_handshake_metadata",
            init_takes_kv_cache_config="required", worker_module="base_worker"),
    VllmApi(releases=VersionRange("0.26", "0.31"), pull_names=_PULL_PUSH, push_name=_PUSH,
            lease="kv_lease", handshake_setter="set_xfer_handshake_metadata_pp_aware",
            init_takes_kv_cache_config="required", worker_module="base_worker"),
    # 0.31.0: a failed handshake is counted by record_failed_handshake()
    VllmApi(releases=VersionRange("0.31", "0.33"), pull_names=_PULL_PUSH, push_name=_PUSH,
            lease="kv_lease", handshake_setter="set_xfer_handshake_metadata_pp_aware",
            init_takes_kv_cache_config="required", worker_module="base_worker",
            failed_handshake_stat="num_failed_handshakes"),
    # 0.33.0: Nx5 strided descriptor arrays straight to prep_xfer_dlist (nixl >= 1.5;
    # the registration patch checks those too)
    VllmApi(releases=VersionRange("0.33", "0.34"), pull_names=_PULL_PUSH, push_name=_PUSH,
            lease="kv_lease", handshake_setter="set_xfer_handshake_metadata_pp_aware",
            init_takes_kv_cache_config="required", worker_module="base_worker",
            failed_handshake_stat="num_failed_handshakes", min_nixl="1.5"),
)


def _span(records: tuple[VllmApi, ...]) -> VersionRange:
    """The one range the records cover; they must follow each other without a gap."""
    for before, after in zip(records, records[1:]):
        if before.releases.below != after.releases.minimum:
            raise AssertionError(f"vllm_api.RELEASES: {before.releases} and "
                                 f"{after.releases} leave a gap or overlap")
    return VersionRange(records[0].releases.minimum, records[-1].releases.below)


# Every vLLM release kvcached-pd knows, derived from the table: the patches' ranges,
# the routing, the metrics, the start-up check and the doctor read this one value, and
# tests/test_config_and_versions.py checks setup.cfg's install_requires against it.
SUPPORTED_VLLM = _span(RELEASES)
SUPPORTED = str(SUPPORTED_VLLM)


def api_for(version: str | None) -> VllmApi | None:
    """The record of ``version`` (default: the installed vLLM), None outside the table."""
    version = version if version is not None else installed_version("vllm")
    if version is None:
        return None
    for record in RELEASES:
        if record.contains(version):
            return record
    return None


@lru_cache(maxsize=1)
def current() -> VllmApi:
    record = api_for(None)
    if record is None:
        raise RuntimeError(f"vLLM {installed_version('vllm')} is outside the releases "
                           f"kvcached-pd's connector knows ({SUPPORTED})")
    return record


# The inner connector kvcached-pd's connector composes when named directly
# (kv_connector="KvcachedPDConnector"): kv_connector_extra_config["kvcached_pd_inner"],
# a pull name or the push name of this release, NixlConnector by default.
INNER_KEY = "kvcached_pd_inner"


def inner_connector_name(kv_transfer_config: Any) -> str:
    """Which of vLLM's NIXL connectors ours composes: the routed name itself, or the one
    the extra config names when ours is named directly."""
    served = current().nixl_names
    name = getattr(kv_transfer_config, "kv_connector", None)
    if name not in served:
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        name = extra.get(INNER_KEY, "NixlConnector")
    if name not in served:
        raise ValueError(f"kv_connector_extra_config[{INNER_KEY!r}]={name!r}: vLLM "
                         f"{installed_version('vllm')} offers {', '.join(served)}")
    return name


# vLLM's NIXL worker logs, at WARNING, each request whose blocks it frees at the end of
# P's lease (the logger: VllmApi.lease_expiry_logger). kvcached-pd's connector frees a
# staged request's blocks on D's DONE, long before; the inner connector's lease still
# runs out later whenever vLLM's own notification did not come (D does not send it when
# P frees on DONE) and would say so for every request: the connector drops that one
# line for its own requests.
LEASE_EXPIRY_MESSAGE = "Releasing expired KV blocks for request"


def is_push(name: str) -> bool:
    return name == current().push_name


def inner_connector_class(name: str = "NixlConnector") -> type:
    """vLLM's NIXL connector class ``name`` (a pull name or the push name)."""
    return getattr(importlib.import_module(NIXL_PACKAGE), name)


def yield_req_data(scheduler_output: Any):
    """(request id, block ids per group, whole table) of every scheduled request.

    The third field is True where the ids are the request's whole block table, not this
    step's additions: vLLM 0.33 names it ``is_full_table`` and sets it for new and
    resumed requests; up to 0.32 it was ``preempted`` (resumed only), which is the same
    for the connector's use, since a new request's table starts empty there."""
    from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data as impl

    return impl(scheduler_output)


def kv_lease_seconds(vllm_config: Any) -> float:
    """How long P holds a finished request's blocks without word from D."""
    if current().lease == "kv_lease":
        cfg = vllm_config.kv_transfer_config
        return float(cfg.get_from_extra_config("kv_lease_duration", 30))
    import vllm.envs as envs

    return float(envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT)


def async_scheduling(vllm_config: Any) -> bool:
    """Whether the engine runs vLLM's asynchronous scheduling (it schedules step N+1 while
    step N runs): ``SchedulerConfig.async_scheduling``, resolved by vLLM (None: its
    default, then on where the executor allows) before any connector is built, in every
    supported release; False where a release lacks it."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(scheduler, "async_scheduling", False))


def side_channel_host() -> str:
    """The host P advertises to D: vLLM's own NIXL side-channel host setting."""
    import vllm.envs as envs

    return str(envs.VLLM_NIXL_SIDE_CHANNEL_HOST)


def side_channel_port(vllm_config: Any) -> int:
    """vLLM's own NIXL side-channel port of this engine (every release 0.20-0.33: the
    ``VLLM_NIXL_SIDE_CHANNEL_PORT`` setting plus the data-parallel index), which a
    push-mode proxy hands D as ``remote_port`` before P has answered."""
    import vllm.envs as envs

    return int(envs.VLLM_NIXL_SIDE_CHANNEL_PORT) + int(
        getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except AssertionError:  # no model-parallel group (single-process tests)
        return 0
