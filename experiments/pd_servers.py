"""Start, watch and stop the vLLM instances (and proxies) of the experiments.

Why this is more than `vllm serve &`:
- several modes' instance pairs run at once, so every instance gets its own HTTP port,
  NIXL side-channel port and KVCACHED_IPC_NAME, and the ports are checked free first;
- every output line is stamped with the wall-clock time as it arrives, so the logs
  give sub-second timings (NIXL registration) whatever each library's log format is;
- the health wait notices an instance that died and shows the tail of its log;
- instances run in their own process group and get a parent-death signal, so neither
  a crash nor a timeout of the harness leaves GPU memory held by orphans;
- the resident memory of each instance's whole process tree (API server, EngineCore)
  can be read from /proc.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pd_common import get, log, write_json
from pd_modes import MANAGED_ENV_PREFIXES, InstanceConfig

# Applied to every vLLM instance (see the README of the GPU host): flashinfer is not
# installed there. The model runner is chosen by model_runner_env().
COMMON_VLLM_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "PYTHONUNBUFFERED": "1",
    "NO_COLOR": "1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}

# Ports below the Linux ephemeral range (32768+), so the random ports vLLM picks for
# its internal sockets cannot collide with ours.
HTTP_PORT_BASE = 18100
SIDE_CHANNEL_PORT_BASE = 25600
PROXY_PORT_BASE = 19100

# Exec'd in the child before the real command: ask the kernel to SIGTERM the child when
# the harness dies (PR_SET_PDEATHSIG survives execve for ordinary binaries). Must be
# spawned from the main thread: the signal fires when the spawning *thread* exits.
_PDEATHSIG_WRAPPER = (
    "import ctypes,os,signal,sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(97)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


# Ports a harness listens on should lie below the kernel's ephemeral range (Linux:
# 32768-60999 by default): a port that is free when it is chosen can be taken as the
# local port of some outgoing connection before the server binds it. The offline tests
# met exactly that (a fake server's "Address already in use" on a port of 36000+); they
# use 11000-15700, below the 20767-31767 the connector tests draw side-channel ports from.


class PortAllocator:
    """Hands out ports that are free now and not handed out before in this run."""

    def __init__(self, start: int):
        self.next_port = start
        self.taken: set[int] = set()

    def take(self) -> int:
        port = self.next_port
        while port in self.taken or not _port_is_free(port):
            port += 1
        self.taken.add(port)
        self.next_port = port + 1
        return port


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@dataclass
class ServeSettings:
    """Settings shared by every vLLM instance of one harness run."""

    model: str
    max_model_len: int
    gpu_memory_utilization: float
    kv_cache_bytes: int | None  # explicit KV budget: immune to peers starting at once
    vllm_cmd: list[str]
    extra_args: list[str] = field(default_factory=list)
    logging_config_path: str | None = None
    kv_role_style: str = "split"  # split: kv_producer/kv_consumer; both: kv_both
    # False: every instance runs eager (--enforce-eager: starts in seconds, not the
    # minute of torch.compile and graph capture); True: vLLM's default, CUDA graphs.
    # Eager decode steps of the test models cost 22-38 ms of host launches (2 x H200,
    # 2026-11-27d), and vLLM PD's decode side runs one step more than one instance before
    # its first token, so TTFT ratios to one instance differ between the two.
    cuda_graphs: bool = False


def serve_settings_from_args(args, **overrides) -> ServeSettings:
    """The harnesses' common serve options (``--kv-cache-gib``, ``--gpu-memory-utilization``,
    ``--vllm-cmd``, ``--extra-serve-args``, ...) as ServeSettings.

    An explicit KV budget makes vLLM's start-up free-memory check the only reader of
    ``--gpu-memory-utilization``, so it defaults low then (0.04) and to 0.12 otherwise."""
    import shlex

    kv_bytes = int(args.kv_cache_gib * (1 << 30)) if args.kv_cache_gib > 0 else None
    gmu = args.gpu_memory_utilization
    if gmu is None:
        gmu = 0.04 if kv_bytes else 0.12
    return ServeSettings(
        model=args.model, max_model_len=args.max_model_len, gpu_memory_utilization=gmu,
        kv_cache_bytes=kv_bytes,
        vllm_cmd=shlex.split(args.vllm_cmd) if args.vllm_cmd else default_vllm_cmd(),
        extra_args=shlex.split(args.extra_serve_args or ""),
        cuda_graphs=bool(getattr(args, "cuda_graphs", False)), **overrides)


def default_vllm_cmd() -> list[str]:
    """`vllm serve` run by this very interpreter, so the harness and the servers see the
    same site-packages."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def serve_args(settings: ServeSettings, port: int, block_size: int,
               kv_transfer: dict | None, instance_args: tuple[str, ...] = ()) -> list[str]:
    """One instance's ``vllm serve`` arguments: the harness's common ones, the instance's
    own (``InstanceConfig.serve_args``), then the run's ``--extra-serve-args`` (last, so an
    operator's flag wins)."""
    args = [
        settings.model,
        "--host", "127.0.0.1",
        "--port", str(port),
        *([] if settings.cuda_graphs else ["--enforce-eager"]),
        "--no-enable-prefix-caching",
        "--max-model-len", str(settings.max_model_len),
        "--block-size", str(block_size),
        "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
        "--seed", "0",
        "--disable-uvicorn-access-log",
    ]
    if settings.kv_cache_bytes:
        args += ["--kv-cache-memory-bytes", str(settings.kv_cache_bytes)]
    if kv_transfer is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer, separators=(",", ":"))]
    return args + list(instance_args) + list(settings.extra_args)


def model_runner_env(vllm_version: str | None = None) -> dict[str, str]:
    """The model runner every instance gets, vanilla ones too so that the modes compare.

    kvcached 0.1.6 refuses vLLM's Model Runner V2 before 0.28 and requires it from 0.29
    (its EngineCore patch raises KVCachedConfigError either way): up to 0.28 the V1 runner
    is pinned, as on 0.26; from 0.29 vLLM's own choice (V2 for the test Llama) stands.
    """
    if vllm_version is None:
        from importlib import metadata

        try:
            vllm_version = metadata.version("vllm")
        except metadata.PackageNotFoundError:
            vllm_version = ""
    m = re.match(r"(\d+)\.(\d+)", vllm_version)
    if m and (int(m.group(1)), int(m.group(2))) >= (0, 29):
        return {}
    return {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def instance_env(config: InstanceConfig, gpu: str, side_channel_port: int, ipc_name: str,
                 logging_config_path: str | None, base: dict[str, str] | None = None
                 ) -> dict[str, str]:
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items() if not k.startswith(MANAGED_ENV_PREFIXES)}
    env.update(COMMON_VLLM_ENV)
    env.update(model_runner_env())
    env.update(config.env)
    env["CUDA_VISIBLE_DEVICES"] = gpu
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    env["KVCACHED_IPC_NAME"] = ipc_name
    if logging_config_path:
        env["VLLM_LOGGING_CONFIG_PATH"] = logging_config_path
    return env


def neutral_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without kvcached / kvcached-pd switches: for helper
    processes (proxies) that must not activate anything."""
    base = dict(os.environ if base is None else base)
    return {k: v for k, v in base.items() if not k.startswith(MANAGED_ENV_PREFIXES)}


def write_vllm_logging_config(path: str) -> str:
    """vLLM's default logging config plus two loggers the experiments need to see:

    - DEBUG for vLLM's NIXL worker module only: vLLM logs the end of KV-cache
      registration only at DEBUG ("Done registering descs", "Created N blocks for src
      engine"); DEBUG everywhere would flood the logs;
    - INFO of the "kvcached_pd" logger, which has no handler of its own: its lines
      ("kvcached-pd: applied ...") show which instances really ran kvcached-pd.
    """
    fmt = "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": {"class": "vllm.logging_utils.NewLineFormatter",
                                "datefmt": "%m-%d %H:%M:%S", "format": fmt}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm",
                              "level": "DEBUG", "stream": "ext://sys.stdout"}},
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
            "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker":
                {"level": "DEBUG", "propagate": True},
            "kvcached_pd": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
        },
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return path


# A server that died at its start because a port was taken between vLLM choosing it and
# binding it: vLLM picks its internal ports (torch.distributed's rendezvous, ...) from the
# kernel's ephemeral range, where any outgoing connection may take one first. On
# 2026-11-27 (2 x H200, lanes T and C starting servers at once) vanilla PD's decode
# engine died with "EADDRINUSE" on port 43671 and the run lost its vanilla column.
# wait_until_ready starts such a server once more (vLLM picks new ports); any other
# death, or a second clash, stays a failure.
PORT_CLASH = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


class ManagedProcess:
    """A child process in its own process group whose output goes, time-stamped, to a log."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: str,
                 health_url: str | None):
        self.name = name
        self.cmd = cmd
        self.env = env
        self.log_path = log_path
        self.health_url = health_url
        self.proc: subprocess.Popen | None = None
        self.state = "new"  # new | starting | ready | failed | stopped
        self.failure: str | None = None
        self.started_at = 0.0
        self.ready_at = 0.0
        self.env_diff: dict[str, str] | None = None  # what start() wrote into the log
        self.restarts = 0  # starts again after a port clash (wait_until_ready)
        self._tail: deque[str] = deque(maxlen=400)
        self._reader: threading.Thread | None = None
        self._log_lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------
    def start(self, env_diff: dict[str, str] | None = None) -> None:
        assert threading.current_thread() is threading.main_thread(), \
            "spawn from the main thread (the parent-death signal is tied to the thread)"
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self.env_diff = env_diff
        logf = open(self.log_path, "ab", buffering=0)
        header = [f"# {self.name} started {time.strftime('%Y-%m-%d %H:%M:%S')}",
                  f"# cmd: {shlex.join(self.cmd)}"]
        for k, v in sorted((env_diff or {}).items()):
            header.append(f"# env: {k}={v}")
        header.append("# each line: <unix time when the harness read it> <line>")
        logf.write(("\n".join(header) + "\n").encode())
        full_cmd = self.cmd
        if sys.platform.startswith("linux"):
            # -S: the wrapper needs no site-packages (and runs no sitecustomize)
            full_cmd = [sys.executable, "-S", "-c", _PDEATHSIG_WRAPPER, str(os.getpid()),
                        *self.cmd]
        self.started_at = time.time()
        try:
            self.proc = subprocess.Popen(full_cmd, env=self.env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        except OSError as exc:
            logf.write(f"# failed to start: {exc}\n".encode())
            logf.close()
            self.state, self.failure = "failed", f"could not start: {exc}"
            return
        self.state = "starting"
        self._reader = threading.Thread(target=self._pump, args=(self.proc.stdout, logf),
                                        name=f"log-{self.name}", daemon=True)
        self._reader.start()

    def restart(self) -> None:
        """Start the process again after it died: what is left of its group (an engine
        process) is killed, its log reader drained; the log gets a second start."""
        self.restarts += 1
        self.signal_group(signal.SIGKILL)
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._tail.clear()
        self.start(self.env_diff)

    def _pump(self, stream, logf) -> None:
        try:
            for raw in iter(stream.readline, b""):
                stamp = f"{time.time():.6f} ".encode()
                with self._log_lock:
                    logf.write(stamp + raw if raw.endswith(b"\n") else stamp + raw + b"\n")
                self._tail.append(raw.decode("utf-8", "replace").rstrip("\n"))
        finally:
            logf.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 60) -> str:
        return "\n".join(list(self._tail)[-n:])

    def check_health(self) -> bool:
        if self.health_url is None:
            return self.alive()
        res = get(self.health_url, timeout=3.0)
        return res.status == 200

    def mark_failed(self, reason: str) -> None:
        self.state = "failed"
        self.failure = reason

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        if self.proc is None:
            return False
        self.proc.poll()  # reap the leader if it exited
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def wait_until_ready(procs: list[ManagedProcess], timeout_s: float,
                     poll_s: float = 1.0) -> None:
    """Poll /health of every starting process until ready, dead or out of time.

    Sets each process's state; a dead one is reported with the tail of its log. One that
    died of a port taken at its start (:data:`PORT_CLASH`) is started once more, within
    the same ``timeout_s``."""
    t_end = time.monotonic() + timeout_s
    pending = [p for p in procs if p.state == "starting"]
    while pending:
        for p in list(pending):
            if not p.alive():
                code = p.proc.returncode if p.proc else None
                time.sleep(0.3)  # let the log reader drain the last lines
                clash = PORT_CLASH.search(p.tail(80)) if p.restarts == 0 else None
                if clash:
                    log(f"RESTART {p.name}: exited with code {code} on a port taken at its "
                        f"start ({clash.group(0)}); starting it once more (log: {p.log_path})")
                    p.restart()
                    if p.state == "starting":
                        continue
                p.mark_failed(f"process exited with code {code} before becoming healthy")
                log(f"FAILED {p.name}: exited with code {code}; last lines of {p.log_path}:\n"
                    + indent(p.tail(40)))
                pending.remove(p)
            elif p.check_health():
                p.state, p.ready_at = "ready", time.time()
                log(f"ready  {p.name} after {p.ready_at - p.started_at:.1f}s")
                pending.remove(p)
        if not pending:
            break
        if time.monotonic() > t_end:
            for p in pending:
                p.mark_failed(f"not healthy after {timeout_s:.0f}s")
                log(f"FAILED {p.name}: not healthy after {timeout_s:.0f}s; last lines:\n"
                    + indent(p.tail(40)))
            break
        time.sleep(poll_s)


def stop_all(procs: list[ManagedProcess], grace_s: float = 10.0) -> None:
    """SIGTERM every process group, wait, then SIGKILL what is left, and wait for the
    groups to be gone so the GPUs are free for whatever runs next."""
    live = [p for p in procs if p.group_alive()]
    for p in live:
        p.signal_group(signal.SIGTERM)
    t_end = time.monotonic() + grace_s
    while time.monotonic() < t_end and any(p.group_alive() for p in live):
        time.sleep(0.2)
    stubborn = [p for p in live if p.group_alive()]
    for p in stubborn:
        log(f"SIGKILL process group of {p.name}")
        p.signal_group(signal.SIGKILL)
    t_end = time.monotonic() + 10.0
    while time.monotonic() < t_end and any(p.group_alive() for p in stubborn):
        time.sleep(0.2)
    for p in procs:
        if p.proc is not None and p.proc.stdout is not None and p._reader is not None:
            p._reader.join(timeout=2.0)
        if p.state in ("starting", "ready"):
            p.state = "stopped"


def indent(text: str, prefix: str = "    | ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


# --------------------------------------------------------------------------------------
# /proc inspection
# --------------------------------------------------------------------------------------


def process_tree(root_pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
            # the command name may contain spaces and parentheses: split after the last ')'
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _status_kib(pid: int) -> dict[str, int | str]:
    info: dict[str, int | str] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    info[key] = int(value.split()[0])
                elif key == "Name":
                    info["Name"] = value.strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            info["cmdline"] = f.read().replace(b"\0", b" ").decode("utf-8", "replace")[:160]
    except OSError:
        pass
    return info


def rss_report(root_pid: int | None) -> dict:
    """Resident memory of a server and all its descendants (EngineCore included)."""
    if root_pid is None or not os.path.isdir("/proc"):
        return {}
    procs = []
    for pid in process_tree(root_pid):
        info = _status_kib(pid)
        if info:
            procs.append({"pid": pid, **info})
    total = sum(int(p.get("VmRSS", 0)) for p in procs)
    peak = sum(int(p.get("VmHWM", 0)) for p in procs)
    return {"total_rss_mib": round(total / 1024, 1), "sum_peak_rss_mib": round(peak / 1024, 1),
            "processes": procs}


# --------------------------------------------------------------------------------------
# Log parsing: NIXL registration time
# --------------------------------------------------------------------------------------

# vLLM 0.26 nixl/base_worker.py: INFO "Registering KV_Caches" at the start of
# register_kv_caches; DEBUG "Registering descs" / "Done registering descs" around
# nixl register_memory; DEBUG "Created N blocks for src engine" once the local transfer
# descriptor list is prepared (the end of registration).
REG_START = re.compile(r"Registering KV_Caches")
REG_MEM_START = re.compile(r"Registering descs")
REG_MEM_END = re.compile(r"Done registering descs")
REG_END = re.compile(r"Created \d+ blocks for src engine")
# Anything else that talks about registering or staging (kvcached, kvcached_pd): kept
# verbatim with its time stamp so a reader can time paths this parser does not know.
REG_OTHER = re.compile(r"(?i)(kvcached|staging|stage).*regist|regist.*(staging|kvcached)")


def registration_timings(log_path: str) -> dict:
    stamps: dict[str, float] = {}
    others: list[dict] = []
    first_stamp = None
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("#"):
                    continue
                stamp_text, _, text = line.partition(" ")
                try:
                    stamp = float(stamp_text)
                except ValueError:
                    continue
                first_stamp = first_stamp or stamp
                for key, rx in (("start", REG_START), ("mem_start", REG_MEM_START),
                                ("mem_end", REG_MEM_END), ("end", REG_END)):
                    if key not in stamps and rx.search(text):
                        # the end markers count only after their start marker
                        if key == "end" and "start" not in stamps:
                            continue
                        if key == "mem_end" and "mem_start" not in stamps:
                            continue
                        stamps[key] = stamp
                if len(others) < 40 and REG_OTHER.search(text):
                    others.append({"t": stamp, "line": text.strip()[:300]})
    except OSError as exc:
        return {"error": str(exc)}

    def span(a: str, b: str) -> float | None:
        return round(stamps[b] - stamps[a], 4) if a in stamps and b in stamps else None

    return {
        "nixl_register_kv_caches_s": span("start", "end"),
        "nixl_register_memory_s": span("mem_start", "mem_end"),
        "markers": stamps,
        "other_registration_lines": others,
        "first_log_line_t": first_stamp,
    }


_PD_APPLIED = re.compile(r"kvcached-pd: applied (\S+)")
_PD_FAILED = re.compile(r"kvcached-pd: patch (\S+) failed")
_PD_ACTIVE = re.compile(r"kvcached-pd: active")
_PD_CORRUPTED = re.compile(r"kvcached-pd TEST: corrupted block")


def kvcached_pd_evidence(log_path: str) -> dict:
    """What an instance's log says about kvcached-pd: patches applied or failed, and how
    many blocks the negative control corrupted. Needs the "kvcached_pd" logger routed to
    the log (write_vllm_logging_config)."""
    applied, failed, active, corrupted = set(), set(), False, 0
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if (m := _PD_APPLIED.search(line)):
                    applied.add(m.group(1))
                elif (m := _PD_FAILED.search(line)):
                    failed.add(m.group(1))
                elif _PD_CORRUPTED.search(line):
                    corrupted += 1
                active = active or bool(_PD_ACTIVE.search(line))
    except OSError:
        pass
    return {"seen": bool(applied or failed or active), "applied": sorted(applied),
            "failed": sorted(failed), "corrupted_blocks_logged": corrupted}


# D logs once per staged peer which wire serves it: "kvcached-pd: staged peer ENGINE rank
# R: ... wire ipc" (or "wire nixl"); the wire-format version on the same line reads
# "wire version N", which this does not take for a wire.
_PD_WIRE = re.compile(r"kvcached-pd: staged peer .*?\bwire (ipc|nixl)\b")


def wire_evidence(log_path: str) -> dict:
    """The wires D's log names for its staged peers: ``wires`` (sorted, distinct) and
    ``peer_lines`` (how many such lines)."""
    wires, lines = set(), 0
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if (m := _PD_WIRE.search(line)):
                    wires.add(m.group(1))
                    lines += 1
    except OSError:
        pass
    return {"wires": sorted(wires), "peer_lines": lines}


# --------------------------------------------------------------------------------------
# Environment description
# --------------------------------------------------------------------------------------


def describe_environment(out_path: str) -> threading.Thread:
    """Write versions, GPUs and where kvcached_pd is imported from (as the servers will
    see it) to ``out_path``, in a background thread: importing vLLM takes seconds that
    the harness spends starting servers meanwhile. Join the returned thread at the end."""
    thread = threading.Thread(target=_describe_environment, args=(out_path,),
                              name="describe-environment", daemon=True)
    thread.start()
    return thread


def _describe_environment(out_path: str) -> None:
    probe = (
        "import json,importlib,sys\n"
        "info={'python':sys.version}\n"
        "for mod in ('torch','vllm','nixl','kvcached','kvcached_pd','sitecustomize'):\n"
        "    try:\n"
        "        m=importlib.import_module(mod)\n"
        "        info[mod]={'version':getattr(m,'__version__',None),\n"
        "                   'file':getattr(m,'__file__',None)}\n"
        "    except Exception as e:\n"
        "        info[mod]={'error':f'{type(e).__name__}: {e}'}\n"
        "print(json.dumps(info))\n")
    info: dict = {"argv": sys.argv, "cwd": os.getcwd(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "PYTHONPATH": os.environ.get("PYTHONPATH")}
    here = os.path.dirname(os.path.abspath(__file__))
    for key, cmd in (("imports", [sys.executable, "-c", probe]),
                     ("nvidia_smi", ["nvidia-smi", "--format=csv,noheader",
                                     "--query-gpu=index,name,memory.used,memory.total"]),
                     ("git", ["git", "-C", here, "rev-parse", "HEAD"])):
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            info[key] = res.stdout.strip() or res.stderr.strip()[-2000:]
            if key == "imports" and res.returncode == 0:
                info[key] = json.loads(res.stdout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            info[key] = f"unavailable: {exc}"
    write_json(out_path, info)
