"""A prefill and a decode instance of kvcached-pd's connector, on the CPU.

Each side is what vLLM builds: its real ``AsyncScheduler`` creating the connector's
scheduler half through vLLM's connector factory, and the connector's worker half
(with vLLM's real ``NixlConnector`` inside, and real NIXL agents over UCX on host
memory) holding that instance's KV caches. :class:`Engine` plays EngineCore's loop
without a model: ``schedule`` -> the worker's connector calls -> ``update_from_output``.
P's "forward" leaves the caches as they are; they were filled with random values, so
D's blocks must end up equal to P's blocks, token for token.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvcached_pd import vllm_api
from tests.support import vllm_nixl_worker as vw

HEADS, HEAD_DIM, LAYERS = 2, 64, 3
# D's wait for P's staged handshake here, where P and D share one process and one GIL:
# once on CI's 2 busy cores P's listener thread did not answer within the product's 5 s,
# and vLLM's own handshake with the same P, in the same process, was logged failing ~6 s
# after the test began (what held P's threads back was not caught). The product's 5 s
# is for P in a process of its own; no test here expects a handshake to time out.
IN_PROCESS_HANDSHAKE_TIMEOUT_S = 30.0
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
MODULE_PATH = "kvcached_pd.connector"


def connector_config(kv_role: str, block_size: int, num_blocks: int, staged: bool = True,
                     engine_id: str | None = None, inner: str = "NixlConnector",
                     extra: dict | None = None, prefix_caching: bool = False):
    """``inner``: vLLM's NIXL connector, plain or inside kvcached-pd's (push mode:
    ``NixlPushConnector``); ``extra``: its kv_connector_extra_config."""
    from vllm.config import KVTransferConfig

    config = vw.make_vllm_config(_model_dir(), block_size=block_size, kv_role=kv_role,
                                 connector=inner)
    if staged:
        config.kv_transfer_config = KVTransferConfig(
            kv_connector="KvcachedPDConnector", kv_connector_module_path=MODULE_PATH,
            kv_role=kv_role, kv_buffer_device="cpu", engine_id=engine_id,
            kv_connector_extra_config={"kvcached_pd_inner": inner, **(extra or {})})
    else:
        if engine_id:
            config.kv_transfer_config.engine_id = engine_id
        if extra:
            config.kv_transfer_config.kv_connector_extra_config = dict(extra)
    config.scheduler_config.async_scheduling = True
    config.cache_config.enable_prefix_caching = prefix_caching
    config.cache_config.num_gpu_blocks = num_blocks
    return config


_MODEL_DIR: list[str] = []


def _model_dir() -> str:
    """One model for every instance of the test process (NIXL's handshake compares the
    model of both sides)."""
    if not _MODEL_DIR:
        _MODEL_DIR.append(vw.write_tiny_llama(tempfile.mkdtemp(), LAYERS, HEADS, HEAD_DIM))
    return _MODEL_DIR[0]


@dataclass
class Engine:
    """One instance: scheduler, worker connector, KV caches."""

    name: str
    sched: Any
    worker: Any
    caches: list[torch.Tensor]
    block_size: int
    port: int = 0  # this instance's VLLM_NIXL_SIDE_CHANNEL_PORT
    outputs: dict[str, Any] = field(default_factory=dict)  # req id -> EngineCoreOutput
    done_seen: set = field(default_factory=set)  # P: (request id, D rank) DONEs received
    # what the EngineCore hands the API server's Prometheus logger: SchedulerStats'
    # kv_connector_stats, one dict of lists per step that carried any
    stats: list[dict] = field(default_factory=list)
    # what vLLM's EngineCore hashes each request's blocks with (prefix caching on)
    block_hasher: Any = None

    @property
    def connector(self):
        return self.sched.get_kv_connector()

    def step(self) -> Any:
        out = self.schedule()
        self.finish(out, self.execute(out))
        return out

    def schedule(self) -> Any:
        # each instance is its own process with its own environment; vLLM reads its
        # side-channel port from the environment when it builds a request's params
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.port)
        return self.sched.schedule()

    def execute(self, out: Any) -> Any:
        """The worker's part of a step (vLLM's model runner without a model): the
        connector's hooks around the forward; the ModelRunnerOutput. ``step`` runs
        ``schedule``, ``execute`` and ``finish`` in order; vLLM's asynchronous scheduling
        schedules the next step before it finishes this one, which a test can do too."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        worker = self.worker
        meta = out.kv_connector_metadata
        if meta is not None:
            worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        extra = {}
        if "failed_recving" in KVConnectorOutput.__dataclass_fields__:
            # vLLM 0.30+: the model runner asks for get_transfer_results
            results = worker.get_transfer_results(out.finished_req_ids)
            sending, recving = results.finished_sending, results.finished_recving
            extra["failed_recving"] = set(results.failed_recving)
        else:
            sending, recving = worker.get_finished(out.finished_req_ids)
        kv_out = KVConnectorOutput(
            **extra,
            finished_sending=set(sending or ()), finished_recving=set(recving or ()),
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=self._report(worker.build_connector_worker_meta()),
            kv_connector_stats=worker.get_kv_connector_stats())
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[self._sampled(r) for r in req_ids], logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None, kv_connector_output=kv_out)

    def finish(self, out: Any, runner: Any) -> None:
        """The scheduler's part after the step ran: vLLM's update_from_output."""
        results = self.sched.update_from_output(out, runner)
        for eco in results.values():
            sched_stats = getattr(eco, "scheduler_stats", None)
            if sched_stats is not None and sched_stats.kv_connector_stats:
                self.stats.append(sched_stats.kv_connector_stats)
            for o in eco.outputs:
                self.outputs[o.request_id] = o

    def _sampled(self, req_id: str) -> list[int]:
        """What the model runner samples: nothing for a prefill chunk that does not
        complete the prompt (vLLM discards it), one token otherwise."""
        req = self.sched.requests.get(req_id)
        if req is not None and req.num_computed_tokens < req.num_prompt_tokens:
            return []
        return [7]

    def series(self, key: str) -> list[float]:
        """Every sample of one stats key the scheduler reported so far."""
        return [v for data in self.stats for v in data.get(key, ())]

    def _report(self, report):
        self.done_seen |= set(getattr(report, "done", ()) or ())
        return report

    def blocks_of(self, req_id: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(req_id)[0])

    def tokens(self, block_ids: list[int], num_tokens: int) -> list[torch.Tensor]:
        """Each layer's K and V of tokens ``[0, num_tokens)`` held in ``block_ids``."""
        from kvcached_pd.transport.layout import AttnCacheSpec, logical_kv_view

        rows = []
        for cache in self.caches:
            view = logical_kv_view(cache, AttnCacheSpec(self.block_size, HEADS, HEAD_DIM))
            rows.append(view[:, block_ids].flatten(1, 2)[:, :num_tokens].clone())
        return rows


def make_engine(name: str, kv_role: str, block_size: int = 16, num_blocks: int = 40,
                seed: int = 0, staged: bool = True, side_channel_port: int = 0,
                caches: list[torch.Tensor] | Callable[[Any], list[torch.Tensor]] | None = None,
                inner: str = "NixlConnector", extra: dict | None = None,
                kv_layouts: tuple[str, ...] = ("LBNHC", "LBHNC"),
                prefix_caching: bool = False, async_scheduling: bool = True) -> Engine:
    """``caches``: the KV caches, or a function of the engine's ``VllmConfig`` that
    allocates them once the layout is resolved (kvcached's allocators need it);
    ``kv_layouts``: what the workers report as supported (vLLM 0.29+), most preferred
    first; ``prefix_caching``: vLLM's ``--enable-prefix-caching``; ``async_scheduling``:
    False builds vLLM's plain ``Scheduler`` (``--no-async-scheduling``, what the README
    advises for a prefill instance) instead of its ``AsyncScheduler``."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    arm_vllm_fixes()
    engine_id = f"{name}-{os.getpid()}-{time.monotonic_ns()}"
    config = connector_config(kv_role, block_size, num_blocks, staged, engine_id, inner, extra,
                              prefix_caching)
    config.scheduler_config.async_scheduling = async_scheduling
    vw.ensure_distributed(config)
    resolve_layout(config, kv_layouts)
    kv_cache_config = vw.kv_cache_config(LAYER_NAMES, num_blocks, block_size, HEADS, HEAD_DIM)
    backend = vw.attention_backend("FLASH_ATTN")
    if callable(caches):
        caches = caches(config)
    if caches is None:
        # what the model runner would allocate for the backend: vLLM's own NixlConnector
        # (the inner one, or a plain peer's) registers per-block regions from that shape
        caches = vw.backend_kv_caches(backend, config, LAYERS, num_blocks, block_size, HEADS,
                                      HEAD_DIM, torch.Generator().manual_seed(seed))
    if side_channel_port:
        port = side_channel_port
        _hold_port(port)  # an engine restarted on its predecessor's port keeps it reserved
    else:
        port = _free_port()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    affinity = os.sched_getaffinity(0)
    try:
        with set_current_vllm_config(config):
            scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
            sched = scheduler_cls(vllm_config=config, kv_cache_config=kv_cache_config,
                                  log_stats=True,
                                  structured_output_manager=StructuredOutputManager(config),
                                  block_size=block_size)
            worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER,
                                                         kv_cache_config)
            worker.register_kv_caches(dict(zip(LAYER_NAMES, caches)))
            handshake = worker.get_handshake_metadata()
            if handshake is not None:  # what vLLM's EngineCore does after registration
                setter = vllm_api.current().handshake_setter
                key = (0, 0) if setter.endswith("pp_aware") else 0
                getattr(sched.get_kv_connector(), setter)({key: handshake})
    finally:
        os.sched_setaffinity(0, affinity)
    decode_worker = getattr(worker, "_decode_worker", None)
    if decode_worker is not None:
        decode_worker.handshake_timeout_s = IN_PROCESS_HANDSHAKE_TIMEOUT_S
    engine = Engine(name, sched, worker, caches, block_size, port,
                    block_hasher=_block_hasher(config, block_size) if prefix_caching else None)
    for executor in _handshake_executors(worker):
        weakref.finalize(engine, _drain, executor)
    weakref.finalize(engine, _release_port, port)
    return engine


def arm_vllm_fixes() -> None:
    """vLLM's NIXL worker as kvcached-pd's activation leaves it in every instance it
    serves: with the fix of vLLM's own handshake race (``nixl_handshake_join``), which
    killed a decode step of this harness once (vLLM 0.30.0, CI, 2026-11-28). The other
    patches concern kvcached's memory and are tested where that memory is stood in for.
    Idempotent; a test that needs vLLM as shipped unpatches it itself."""
    from kvcached_pd.patches import get_patch

    patch = get_patch("nixl_handshake_join")
    if patch.applies()[0] and not patch.is_patched():
        patch.patch()


def _handshake_executors(worker) -> list:
    """The handshake threads of vLLM's NIXL connector worker inside ``worker`` (kvcached-pd's
    connector's inner one, or vLLM's own connector)."""
    found = []
    for connector in (worker, getattr(worker, "_inner", None)):
        inner_worker = getattr(connector, "connector_worker", None)
        executor = getattr(inner_worker, "_handshake_initiation_executor", None)
        if executor is not None:
            found.append(executor)
    return found


def _drain(executor, timeout_s: float = 60.0) -> None:
    """Wait until the handshake ``executor`` (vLLM: one thread) has finished what it runs.

    Runs when an engine is collected, before its worker is: vLLM's worker then releases
    its NIXL handles and its agent goes with it, and a handshake still inside
    ``add_remote_agent`` on that agent aborted the whole test process (SIGABRT in the
    NIXL group, vLLM 0.28.0 and 0.20.2 on 2 cores, about 1 run in 5; the main thread
    was in no Python frame: a destructor)."""
    try:
        executor.submit(int).result(timeout=timeout_s)  # FIFO behind the running one
    except Exception:  # noqa: BLE001 - shut down already, or a handshake that failed
        pass


def _block_hasher(config, block_size: int):
    """vLLM's EngineCore hashes a request's full blocks when it creates the request; the
    prefix cache finds a prompt's cached blocks by those hashes."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def resolve_layout(config, kv_layouts: tuple[str, ...] = ("LBNHC", "LBHNC")) -> None:
    """What the EngineCore does before any worker allocates (vLLM 0.29+: resolve the KV
    layout once from what the workers support); before 0.29 each worker decides, and
    caches the answer per process, which is forgotten here."""
    vw.forget_resolved_layout()
    try:
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    except ImportError:
        return
    resolve_kv_cache_layout(config, [list(kv_layouts)])


def cpu_vllm():
    """vLLM on the CPU for the whole test: the attention backend a GPU would pick and
    vLLM's CPU platform (the inner connector's handshake thread asks for it too)."""
    return vw.backend_lookup(vw.attention_backend("FLASH_ATTN"))


# Test processes (the test command runs release groups side by side) reserve side-channel
# ports through these lock files before they bind them: the kernel never hands out a port
# below its ephemeral range, but two test processes drawing from one range could.
PORT_LOCK_DIR = os.path.join(tempfile.gettempdir(), "kvcached-pd-test-ports")
_held_ports: dict[int, list[int]] = {}  # port -> [lock file descriptor, engines using it]


def _hold_port(port: int) -> bool:
    """Reserve ``port`` (and its claim port, ``port + CLAIM_PORT_OFFSET``) for an engine of
    this process, against every other test process; False: another one holds it. The
    lock goes with the last engine of this process using the port (:func:`_release_port`),
    or with the process."""
    held = _held_ports.get(port)
    if held is not None:
        held[1] += 1
        return True
    os.makedirs(PORT_LOCK_DIR, exist_ok=True)
    fd = os.open(os.path.join(PORT_LOCK_DIR, str(port)), os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _held_ports[port] = [fd, 1]
    return True


def _release_port(port: int) -> None:
    held = _held_ports.get(port)
    if held is None:
        return
    held[1] -= 1
    if held[1] <= 0:
        del _held_ports[port]
        os.close(held[0])


def _side_channel_ports(ephemeral_low: int) -> list[int]:
    """The ports a test engine's side channel may take: below the kernel's ephemeral range,
    in bands of CLAIM_PORT_OFFSET ports whose next band holds their claim ports, so that
    no engine's side-channel port is another's claim port and one lock covers both."""
    from kvcached_pd.connector.side_channel import CLAIM_PORT_OFFSET

    top = ephemeral_low - 1
    bands = 5
    low = max(1024, top - 2 * bands * CLAIM_PORT_OFFSET)
    return [port for port in range(low, top - CLAIM_PORT_OFFSET)
            if ((port - low) // CLAIM_PORT_OFFSET) % 2 == 0]


def _free_port() -> int:
    """A side-channel port whose claim port (push mode's staged listener) is free too,
    both below the kernel's ephemeral range, reserved for this process (:func:`_hold_port`).
    A port the kernel hands out between this choice and vLLM's bind (the UCX listeners and
    connections of the engine's NIXL agents take ephemeral ports), or one another test
    process chose in that window, kills vLLM's handshake listener thread, and its
    ``set_xfer_handshake_metadata`` then waits forever (one vLLM 0.30 run hung so before
    the ports left the ephemeral range; the 0.26.0 and 0.31.0 groups of two test-command
    runs on 2026-11-27, side by side with other groups, after); a claim port taken moves
    P's staged listener (a concurrent-push test failed so). The caller releases the
    reservation (:func:`_release_port`)."""
    import random
    import socket

    from kvcached_pd.connector.side_channel import claim_port

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    ports = _side_channel_ports(ephemeral_low)
    for _ in range(400):
        port = random.choice(ports)
        if port in _held_ports or not _hold_port(port):
            continue
        with socket.socket() as s, socket.socket() as claim:
            try:
                s.bind(("127.0.0.1", port))
                claim.bind(("127.0.0.1", claim_port(port)))
            except OSError:
                _release_port(port)
                continue
        return port
    raise RuntimeError("no free port pair for a side channel and its claim port")


def prefill_request(req_id: str, prompt: list[int], block_hasher=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    req = Request(request_id=req_id, prompt_token_ids=list(prompt),
                  sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                  pooling_params=None, block_hasher=block_hasher)
    req.kv_transfer_params = {"do_remote_decode": True, "do_remote_prefill": False}
    return req


def decode_request(req_id: str, prompt: list[int], params: dict, max_tokens: int = 3,
                   block_hasher=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    req = Request(request_id=req_id, prompt_token_ids=list(prompt),
                  sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  pooling_params=None, block_hasher=block_hasher)
    req.kv_transfer_params = dict(params)
    return req


def prefilled(p: Engine, req_id: str, prompt: list[int]) -> dict:
    """Run ``req_id`` through P alone; the kv_transfer_params P hands the decode leg."""
    p.sched.add_request(prefill_request(req_id, prompt))
    assert run([p], lambda: req_id in p.outputs)
    return p.outputs[req_id].kv_transfer_params


def wrap_method(obj: Any, name: str, around: Callable[..., Any]) -> None:
    """Make ``obj.name(*args)`` call ``around(real, *args)``, where ``real`` calls the
    method as it was, without a reference cycle: the wrapper stored on ``obj`` holds
    ``obj`` only weakly. A wrapper holding ``obj``'s bound method kept a test's worker
    alive past its engine, in a cycle the cyclic collector freed at some later point,
    inside another test, while that test's vLLM handshake thread was in NIXL's
    add_remote_agent: the NIXL group's SIGABRT (2 of 16 groups in a fresh-clone run,
    2026-11-26, both in tests that wrapped a worker's method this way)."""
    own = vars(obj).get(name)
    if own is not None:
        real = own
    else:
        method, ref = getattr(type(obj), name), weakref.ref(obj)

        def real(*args: Any, **kwargs: Any) -> Any:
            return method(ref(), *args, **kwargs)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return around(real, *args, **kwargs)

    setattr(obj, name, wrapper)


def record_load_errors(d: Engine) -> list[int]:
    """Every block id D's worker reports as failed to load, from now on."""
    seen: list[int] = []

    def load_errors(real):
        blocks = real()
        seen.extend(blocks)
        return blocks

    wrap_method(d.worker, "get_block_ids_with_load_errors", load_errors)
    return seen


def run(engines: list[Engine], until, timeout_s: float = 30.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for engine in engines:
            engine.step()
        if until():
            return True
        time.sleep(0.002)
    return False
