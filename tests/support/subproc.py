"""Run Python code in a fresh interpreter: activation is per process, so its tests
(gate on/off, import orders, sitecustomize chaining) each need one.

Two ways, both giving a process that has never activated kvcached-pd:

* :func:`run` starts a new interpreter (``python -c``): what the bootstrap tests need,
  since they test what happens at interpreter start (``sitecustomize``, ``-S``, ``.pth``).
* :func:`run_forked` forks it from a server process that imported torch and vLLM's
  config, connector and scheduler modules once, with kvcached-pd's gate closed, and
  never imported kvcached-pd. Importing those costs 8-15 s of CPU per interpreter on a
  2-core machine, and ``tests/test_startup_guard.py`` alone started about 40 of them per
  vLLM release (about half of a release's test time). The child takes the case's
  environment, working directory and ``PYTHONPATH`` entries before the code runs, so
  everything kvcached-pd does (plugin loading, activation, settings) happens in the
  child exactly as in a new interpreter; what it inherits is only modules whose state
  does not depend on the environment at import (the server checks at start that
  kvcached-pd, kvcached and vLLM's plugin loading are untouched).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def clean_env(**overrides: str) -> dict[str, str]:
    from kvcached_pd.config import VARIABLE_NAMES  # every variable kvcached-pd reads

    env = {k: v for k, v in os.environ.items()
           if k not in VARIABLE_NAMES and not k.startswith(("KVCACHED", "ENABLE_KVCACHED"))
           or k == "KVCACHED_SRC"}  # where the tests' kvcached source is: not a setting
    env.pop("PYTHONPATH", None)
    env["HF_HUB_OFFLINE"] = "1"
    env.update(overrides)
    return env


def run(code: str, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
        cwd: str | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)],
        env=env if env is not None else clean_env(), cwd=cwd or REPO,
        capture_output=True, text=True, timeout=timeout,
    )


def run_json(code: str, **kwargs) -> dict:
    """Run ``code``, which must print one JSON object as its last stdout line."""
    return _last_json(run(code, **kwargs))


def run_forked(code: str, env: dict[str, str] | None = None, cwd: str | None = None,
               timeout: int = 240) -> subprocess.CompletedProcess:
    """:func:`run` for code that needs a process where kvcached-pd never ran, not a
    new interpreter: forked from a server that imported vLLM once (module docstring)."""
    return _server().run(textwrap.dedent(code), env if env is not None else clean_env(),
                         cwd or REPO, timeout)


def run_forked_json(code: str, **kwargs) -> dict:
    return _last_json(run_forked(code, **kwargs))


def _last_json(proc: subprocess.CompletedProcess) -> dict:
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The server: reads one JSON request per line on stdin, forks a child per request, and
# answers one JSON line with the child's exit code and output (files, so that output
# written by C code is caught too).
_SERVER = r"""
import json, os, sys, tempfile, time, traceback
proto = os.fdopen(os.dup(1), "w")  # answers only; anything else printed goes to stderr
os.dup2(2, 1)
import torch
import vllm.config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
import vllm.v1.core.sched.scheduler
import vllm.plugins
# vLLM inspects a model's architecture once per process (its registry's caches): warm it,
# with a model config alone (a config naming a KV connector imports the connector)
import tempfile as _t
from tests.support import vllm_nixl_worker as _vw
vllm.config.ModelConfig(model=_vw.write_tiny_llama(_t.mkdtemp()), dtype="float16",
                        skip_tokenizer_init=True)
# what must stay untouched for a child to be as new as a fresh interpreter: kvcached(-pd),
# and vLLM's NIXL connector, whose import is where kvcached-pd's and kvcached's patches
# meet (the import-order tests import it in the child; 0.1 s there once the rest is in)
assert not any(m == "kvcached_pd" or m.startswith(("kvcached_pd.", "kvcached"))
               for m in sys.modules), "the fork server imported kvcached(-pd)"
assert not any(m.startswith("vllm.distributed.kv_transfer.kv_connector.v1.nixl")
               for m in sys.modules), "the fork server imported vLLM's NIXL connector"
assert not getattr(vllm.plugins, "plugins_loaded", False), "vLLM's plugins were loaded"
base_path = list(sys.path)
print("ready", file=proto, flush=True)
for line in sys.stdin:
    req = json.loads(line)
    out = tempfile.NamedTemporaryFile(delete=False)
    err = tempfile.NamedTemporaryFile(delete=False)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.environ.clear()
            os.environ.update(req["env"])
            os.chdir(req["cwd"])
            extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            sys.path[:] = base_path[:1] + extra + base_path[1:]
            sys.argv = ["-c"]
            exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    deadline = time.monotonic() + req["timeout"]
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        status = None
    rc = os.waitstatus_to_exitcode(status) if status is not None else "timeout"
    answer = {"rc": rc}
    for name, f in (("stdout", out), ("stderr", err)):
        f.close()
        with open(f.name, errors="replace") as r:
            answer[name] = r.read()
        os.unlink(f.name)
    print(json.dumps(answer), file=proto, flush=True)
"""


class _ForkServer:
    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")  # its stderr: read only on failure
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], env=clean_env(), cwd=REPO, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        first = self.proc.stdout.readline()
        if first.strip() != "ready":
            raise RuntimeError(f"the fork server did not start:\n{first}{self._log()}")
        self.lock = threading.Lock()

    def run(self, code: str, env: dict[str, str], cwd: str,
            timeout: int) -> subprocess.CompletedProcess:
        with self.lock:
            self.proc.stdin.write(json.dumps(
                {"code": code, "env": env, "cwd": cwd, "timeout": timeout}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died:\n{self._log()}")
        answer = json.loads(line)
        if answer["rc"] == "timeout":
            raise subprocess.TimeoutExpired(["<forked>", code], timeout,
                                            answer["stdout"], answer["stderr"])
        return subprocess.CompletedProcess(["<forked>", code], answer["rc"],
                                           answer["stdout"], answer["stderr"])

    def _log(self) -> str:
        self.log.seek(0)
        return self.log.read()[-20000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_INSTANCE: list[_ForkServer] = []


def _server() -> _ForkServer:
    if not _INSTANCE or _INSTANCE[0].proc.poll() is not None:
        _INSTANCE[:] = [_ForkServer()]
        atexit.register(_INSTANCE[0].close)
    return _INSTANCE[0]
