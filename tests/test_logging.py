"""kvcached-pd's INFO lines appear under vLLM's default logging, as vLLM's own do.

A plain ``vllm serve`` configures only vLLM's ``vllm`` logger; without routing, the
start-up line, the "applied" lines and the trace lines (all INFO) were dropped. Each
case is a fresh interpreter with vLLM's default logging configuration (no logging
config of the operator's), activated the two documented ways.
"""

from __future__ import annotations

import os

import pytest

from tests.support import kvcached_cpu, subproc

ON = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_CONTIGUOUS_LAYOUT="false")

IMPORT_NIXL = "import vllm.distributed.kv_transfer.kv_connector.v1.nixl\n"
# What `vllm serve` does first on vLLM 0.31+, which no longer configures logging when
# vllm.logger is imported: its CLI configures it from the parsed arguments (defaults
# here). Earlier releases have no such step; the import configured them.
SERVE_CONFIGURES_LOGGING = (
    "import argparse, vllm.logger as vllm_logger\n"
    "if hasattr(vllm_logger, 'configure_logging_from_args'):\n"
    "    vllm_logger.configure_logging_from_args(argparse.Namespace())\n")


def vllm_default_logging(**env) -> dict[str, str]:
    env = subproc.clean_env(**env)
    for name in ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL"):
        env.pop(name, None)
    return env


def info_lines(stdout: str) -> list[str]:
    """vLLM's INFO lines of kvcached-pd (0.31+ put "(MainProcess pid=...)" first)."""
    return [line for line in stdout.splitlines()
            if "INFO" in line.split("kvcached-pd:")[0].split() and "kvcached-pd:" in line]


@pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched")
def test_plugin_entry_point_logs_through_vllms_handler():
    code = ("from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
            + SERVE_CONFIGURES_LOGGING + IMPORT_NIXL)
    proc = subproc.run(code, env=vllm_default_logging(PYTHONPATH=kvcached_cpu.kvcached_src(), **ON))
    assert proc.returncode == 0, proc.stderr
    lines = info_lines(proc.stdout)  # vLLM's handler writes to stdout in vLLM's format
    assert any("kvcached-pd: active (vLLM" in line and "transport" in line
               and "wire auto: per peer at its handshake" in line for line in lines), proc.stdout
    assert any("kvcached-pd: applied nixl_layout" in line for line in lines), proc.stdout


@pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched")
def test_checkout_sitecustomize_logs_once_vllm_configured_logging(tmp_path):
    """Activated before vLLM is imported: the start-up line waits for vLLM's logging
    (on 0.31+ for vLLM to configure it: logged while the ``vllm`` logger still had
    Python's default WARNING level, it was dropped, and kvcached-pd's level pinned there
    dropped every later INFO line too)."""
    env = vllm_default_logging(
        PYTHONPATH=os.pathsep.join([subproc.REPO, kvcached_cpu.kvcached_src()]), **ON)
    proc = subproc.run("import vllm\n" + SERVE_CONFIGURES_LOGGING + IMPORT_NIXL, env=env,
                       cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = info_lines(proc.stdout)
    assert sum("kvcached-pd: active (vLLM" in line for line in lines) == 1, proc.stdout
    assert any("kvcached-pd: applied nixl_registration" in line for line in lines), proc.stdout


@pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched")
def test_held_lines_reach_a_logging_config_file_that_names_kvcached_pd(tmp_path):
    """An operator's (or the harness's) VLLM_LOGGING_CONFIG_PATH that configures
    ``kvcached_pd`` itself: vLLM 0.31+ applies it with dictConfig, which replaced the
    handler holding the lines logged before, and those lines (the start-up line, the
    "applied" lines) were lost (2 x H200, vLLM 0.33.0, 2026-11-26). On 0.20-0.30 the file
    is applied when vllm.logger is imported, before kvcached-pd logs anything."""
    import json

    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "FILE %(levelname)s %(name)s %(message)s"}},
        "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain",
                             "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
                    "kvcached_pd": {"handlers": ["out"], "level": "INFO", "propagate": False}},
    }
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    env = vllm_default_logging(
        PYTHONPATH=os.pathsep.join([subproc.REPO, kvcached_cpu.kvcached_src()]), **ON)
    env["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    proc = subproc.run("import vllm\n" + SERVE_CONFIGURES_LOGGING + IMPORT_NIXL, env=env,
                       cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    ours = [line for line in proc.stdout.splitlines()
            if line.startswith("FILE INFO kvcached_pd") and "kvcached-pd:" in line]
    assert sum("kvcached-pd: active (vLLM" in line for line in ours) == 1, proc.stdout
    assert any("kvcached-pd: applied nixl_registration" in line for line in ours), proc.stdout
