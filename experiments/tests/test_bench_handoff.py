"""bench_handoff's CPU-runnable parts: the server-like step, both API generations, the
baseline run's command line and the summary (the GPU run is the lead's)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

EXP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, EXP)

import bench_handoff  # noqa: E402

SMOKE = ["--device", "cpu", "--small", "--iters", "2", "--warmup", "0",
         "--layouts", "kvcached_contiguous"]


def run(tmp_path: Path, K, *extra: str) -> dict:
    args = bench_handoff.parse_args([*SMOKE, "--out", str(tmp_path), *extra])
    return bench_handoff.bench(args, K)


def test_a_step_packs_checks_and_unpacks_as_the_servers_do(tmp_path):
    K = bench_handoff.load(None)
    assert K.has_started and K.has_read_tags  # this checkout's API
    result = run(tmp_path, K)
    assert [r["mib"] for r in result["rows"]] == pytest.approx([1 / 16, 1 / 4], abs=2e-3)
    for row in result["rows"]:
        assert set(bench_handoff.METRICS) <= set(row) and row["iters"] == 2
        assert row["effective"] == pytest.approx(row["p_device"] + row["d_device"], abs=2e-4)
        assert row["p_device"] <= row["p_span"] + 1e-3  # started after the span's event
    text = bench_handoff.render([result])
    assert "kvcached_contiguous" in text and "started event: True" in text


def test_an_older_checkout_is_timed_where_its_servers_timed_it(tmp_path):
    """Without the ``started`` event the device time starts where the servers started
    it then (before the host's work: span and device time are one), and without
    ``read_tags`` each tag is read alone."""
    K = bench_handoff.load(None)
    K.has_started = K.has_read_tags = False
    read_alone = []
    tokens = K.tokens  # an older tokens module: no read_tags
    K.tokens = SimpleNamespace(
        tag_bytes=tokens.tag_bytes, check_tag=tokens.check_tag, new_token=tokens.new_token,
        read_tag=lambda extent, stream=None: read_alone.append(1) or tokens.read_tag(extent, stream))
    result = run(tmp_path, K, "--batches", "2")
    assert len(read_alone) == 2 * 2 * len(result["rows"])  # 2 requests, 2 steps each
    for row in result["rows"]:
        assert row["p_device"] == row["p_span"] and row["d_device"] == row["d_span"]


def test_a_handoff_that_moves_nothing_is_caught(tmp_path, monkeypatch):
    K = bench_handoff.load(None)
    monkeypatch.setattr(K.pack, "unpack_request", lambda *a, **k: None)
    with pytest.raises(AssertionError, match="differ"):
        run(tmp_path, K)


def test_the_baseline_runs_the_same_options_from_the_other_checkout(tmp_path):
    argv = [*SMOKE, "--out", str(tmp_path), "--baseline", "/old", "--label=x", "--src", "/me"]
    cmd = bench_handoff.baseline_command(argv, "/old", tmp_path / "base")
    assert cmd[2:] == [*SMOKE, "--src", "/old", "--label", "base", "--out", str(tmp_path / "base")]


def test_main_writes_the_json_and_one_table(tmp_path, capsys):
    assert bench_handoff.main([*SMOKE, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_handoff.json").read_text())
    assert result["label"] == "this" and len(result["rows"]) == 2
    out = capsys.readouterr().out
    assert out.endswith((tmp_path / "summary.txt").read_text())
    assert "medians in ms" in out
