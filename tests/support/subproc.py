"""Run Python code in a fresh interpreter: activation is per process, so its tests
(gate on/off, import orders, sitecustomize chaining) each need one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

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
    proc = run(code, **kwargs)
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
