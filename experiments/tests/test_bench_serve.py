"""bench_serve.py: its `vllm bench serve` command lines parse with vLLM's own parser and
say what the summary claims (round 2 repeats round 1 exactly; the prefix workload is
vLLM's prefix_repetition), and its options refuse what cannot run before a server starts.

Skipped where vLLM is not installed (its parser is the point).

run: <python with vllm> -m pytest experiments/tests/test_bench_serve.py -q
"""

from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("vllm")

import bench_serve  # noqa: E402


@pytest.fixture(scope="module")
def client_parser():
    from vllm.benchmarks.serve import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser


def parsed(parser, a, workload):
    cmd = bench_serve.client_cmd(a, "http://127.0.0.1:19100", workload, "/tmp/x/r.json")
    i = cmd.index("serve")
    return parser.parse_args(cmd[i + 1:])


def test_the_rounds_are_one_command_and_parse(client_parser):
    a = bench_serve.parse_args(["--out", "/tmp/x", "--model", "/tmp/tiny"])
    r1, r2 = parsed(client_parser, a, "round1"), parsed(client_parser, a, "round2")
    assert vars(r1) == vars(r2)  # the same prompts: the same seed, dataset and sizes
    assert (r1.dataset_name, r1.random_input_len, r1.random_output_len, r1.num_prompts,
            r1.max_concurrency, r1.seed) == ("random", 2000, 16, 64, 16, 0)
    assert r1.base_url == "http://127.0.0.1:19100" and r1.endpoint == "/v1/completions"
    assert r1.save_result and r1.result_filename == "r.json" and r1.ignore_eos


def test_the_prefix_workload_is_vllms_prefix_repetition(client_parser):
    a = bench_serve.parse_args(["--out", "/tmp/x", "--prefix-len", "1000", "--suffix-len",
                                "100", "--num-prefixes", "3", "--prefix-seed", "7"])
    p = parsed(client_parser, a, "prefix")
    assert (p.dataset_name, p.prefix_repetition_prefix_len, p.prefix_repetition_suffix_len,
            p.prefix_repetition_num_prefixes, p.prefix_repetition_output_len, p.seed) == \
        ("prefix_repetition", 1000, 100, 3, 16, 7)


@pytest.mark.parametrize("argv", [
    ["--workloads", "round2"],  # round 2 repeats round 1
    ["--workloads", "round3"],
    ["--modes", "kvpd-staged,nope"],
    ["--input-len", "4090"],  # + 16 out > --max-model-len 4096
    ["--num-prompts", "0"],
])
def test_bad_options_stop_before_any_server(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench_serve.parse_args(["--out", "/tmp/x"] + argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_the_verdict_fails_a_mode_with_failed_requests():
    ok = {"client": {"completed": 4, "failed": 0}, "workload": "round1",
          "counters": {"kvpd_moved_bytes": 0.0, "nixl_bytes": None}}
    bad = {"client": {"completed": 3, "failed": 1}, "workload": "round2",
           "counters": {"kvpd_moved_bytes": 0.0, "nixl_bytes": None}}
    doc = {"num_prompts": 4, "modes": [{"name": "kvpd-push", "workloads": [ok, bad],
                                        "wire": {"status": "pass", "detail": ""}}]}
    verdict, problems = bench_serve.verdict(doc)
    assert verdict == "FAIL" and "kvpd-push/round2" in problems[0]
    doc["modes"][0]["workloads"] = [ok]
    assert bench_serve.verdict(doc) == ("PASS", [])


def test_a_kvcached_setting_is_handed_to_the_load_harness(tmp_path):
    a = bench_serve.parse_args(["--out", str(tmp_path), "--model", str(tmp_path),
                                "--kvcached-env", "KVCACHED_MAX_CACHED_TOKENS=200000"])
    la = bench_serve.load_harness_args(a)
    assert la.kvcached_env == {"KVCACHED_MAX_CACHED_TOKENS": "200000"}
    assert bench_serve.load_harness_args(
        bench_serve.parse_args(["--out", str(tmp_path), "--model", str(tmp_path)])
    ).kvcached_env == {}
