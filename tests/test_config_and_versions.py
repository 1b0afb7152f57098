"""Settings, version ranges and byte-span helpers: pure functions, no vLLM needed."""

from __future__ import annotations

import pytest
import torch

from kvcached_pd import checks, config, vllm_api
from kvcached_pd.kv_spans import clip_to, merge_spans, physical_spans
from kvcached_pd.versions import VersionRange, parse_release
from kvcached_pd.vllm_api import SUPPORTED_VLLM

KNOWN = frozenset({"nixl_layout", "nixl_registration"})


@pytest.mark.parametrize("version,release", [
    ("0.26.0", (0, 26, 0)), ("0.26.1.dev12+g0abc123", (0, 26, 1)), ("0.27.0rc1", (0, 27, 0)),
    ("0.30", (0, 30, 0)), ("v0.20.2", (0, 20, 2)), ("0.26.0+cu130", (0, 26, 0)),
])
def test_release_numbers_including_dev_builds(version, release):
    assert parse_release(version) == release


def test_supported_range_edges():
    assert SUPPORTED_VLLM.contains("0.20.0") and SUPPORTED_VLLM.contains("0.33.9")
    assert SUPPORTED_VLLM.contains("0.33.1.dev3+gdeadbee")
    assert not SUPPORTED_VLLM.contains("0.19.1") and not SUPPORTED_VLLM.contains("0.34.0.dev1")
    assert str(VersionRange("0.24", "0.31")) == ">=0.24,<0.31"
    with pytest.raises(ValueError, match="cannot read a release"):
        parse_release("nightly")


def _setup_cfg_requirement(name: str) -> str:
    import configparser
    import pathlib

    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).resolve().parents[1] / "setup.cfg")
    for line in cfg["options"]["install_requires"].splitlines():
        line = line.strip()
        if line.startswith(name) and not line.startswith("#"):
            return line[len(name):]
    raise AssertionError(f"setup.cfg requires no {name}")


def test_every_vllm_bound_is_the_release_tables():
    """The next vLLM release is one row of vllm_api.RELEASES: setup.cfg (which cannot
    import the table) says the same range, and every patch's range is the table's or
    lies inside it (routing, metrics, layout and registration patches read it)."""
    from kvcached_pd.patches import PATCHES, get_patch

    assert _setup_cfg_requirement("vllm") == str(SUPPORTED_VLLM)
    for name in ("connector_routing", "connector_metrics", "nixl_layout", "nixl_registration"):
        assert get_patch(name).vllm_range is SUPPORTED_VLLM, name
    low, high = parse_release(SUPPORTED_VLLM.minimum), parse_release(SUPPORTED_VLLM.below)
    for patch in PATCHES:
        if patch.vllm_range is not None:
            assert low <= parse_release(patch.vllm_range.minimum) and \
                parse_release(patch.vllm_range.below) <= high, patch.name
    for version in ("0.20.2", "0.26.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"):
        assert vllm_api.api_for(version) is not None, version


def test_release_table_rows_must_follow_each_other():
    rows = vllm_api.RELEASES
    gap = (rows[0], vllm_api.VllmApi(**{**rows[1].__dict__,
                                        "releases": VersionRange("0.24", "0.26")}))
    with pytest.raises(AssertionError, match="gap or overlap"):
        vllm_api._span(gap)


@pytest.mark.parametrize("vllm_version,nixl_version,refused", [
    ("0.33.0", "1.4.2", True), ("0.33.0", "1.5.1", False), ("0.30.0", "0.7.1", False),
    ("0.32.0", "1.0.0", False),
])
def test_the_nixl_a_release_starts_with(vllm_version, nixl_version, refused):
    """setup.cfg asks for the oldest NIXL of the whole range (nixl>=0.7); vLLM 0.33's
    strided lists need 1.5, checked at start-up with the command that fixes it."""
    problems = checks.nixl_version_problems(vllm_version, nixl_version)
    assert bool(problems) is refused
    if refused:
        assert "pip install 'nixl>=1.5'" in problems[0]


@pytest.mark.parametrize("env,open_", [
    ({}, False),
    ({"ENABLE_KVCACHED": "true"}, True),  # kvcached's .pth defaults KVCACHED_AUTOPATCH to 1
    ({"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "0"}, False),
    ({"ENABLE_KVCACHED": "yes", "KVCACHED_AUTOPATCH": "1"}, False),  # kvcached: only true/1
    ({"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1"}, True),
    ({"ENABLE_KVCACHED": "true", "KVCACHED_PD": "maybe"}, True),  # armed to refuse it
    ({"KVCACHED_PD": "maybe"}, True),
    ({"ENABLE_KVCACHED": "TRUE", "KVCACHED_AUTOPATCH": "true", "KVCACHED_PD": "0"}, False),
    ({"KVCACHED_PD": "1"}, True),
    ({"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1", "KVCACHED_PD": ""}, True),
])
def test_gate(env, open_):
    assert config.gate_open(env) is open_


def test_settings_report_every_bad_value():
    s = config.read_settings({
        "KVCACHED_PD_DISABLE": "nixl_layout, bogus", "KVCACHED_PD_TRANSPORT": "udp",
        "KVCACHED_PD_STAGING_MB": "-5", "KVCACHED_PD_STRICT": "maybe",
        "KVCACHED_PD_READ_SPIN_US": "1e3", "KVCACHED_PD_TRACE": "sometimes",
    })
    text = "\n".join(checks.setting_problems(s, KNOWN))
    assert "unknown patch(es) ['bogus']" in text and "'udp'" in text
    assert "bogus" not in "\n".join(s.problems)  # config knows no patch table
    assert "KVCACHED_PD_STAGING_MB='-5'" in text and "KVCACHED_PD_STRICT='maybe'" in text
    assert "KVCACHED_PD_READ_SPIN_US='1e3'" in text and "KVCACHED_PD_TRACE='sometimes'" in text
    assert s.read_spin_us == config.DEFAULT_READ_SPIN_US and not s.trace
    assert s.disabled_patches == {"nixl_layout", "bogus"}
    assert s.transport == config.DEFAULT_TRANSPORT and s.staging_mb == config.DEFAULT_STAGING_MB


def test_settings_defaults_are_clean():
    s = config.read_settings({})
    assert s.problems == () and not s.strict and not s.test_corrupt
    assert s.transport == "direct"  # plain vLLM keeps vLLM's own data path
    assert s.read_spin_us == config.DEFAULT_READ_SPIN_US and not s.trace


@pytest.mark.parametrize("raw, expected", [("0", 0), (" 250 ", 250), ("20000", 20000)])
def test_read_spin_budget_accepts_zero_to_max(raw, expected):
    s = config.read_settings({"KVCACHED_PD_READ_SPIN_US": raw})
    assert (s.read_spin_us, s.problems) == (expected, ())


def test_read_spin_budget_above_max_is_a_problem():
    s = config.read_settings({"KVCACHED_PD_READ_SPIN_US": "20001"})
    assert len(s.problems) == 1 and "KVCACHED_PD_READ_SPIN_US" in s.problems[0]


def test_staged_transport_is_the_default_with_kvcached():
    assert config.read_settings({"ENABLE_KVCACHED": "true"}).transport == "staged"
    off = config.read_settings({"ENABLE_KVCACHED": "true", "KVCACHED_PD_TRANSPORT": "direct"})
    assert off.transport == "direct" and off.problems == ()


def test_split_half_view_has_two_physical_spans():
    raw = torch.zeros(1000, dtype=torch.float16)
    # K blocks at [0, 40), V blocks at [500, 540): kvcached's split-half layout
    view = torch.as_strided(raw, (2, 10, 4), (500, 4, 1))
    base = raw.data_ptr()
    assert physical_spans(view) == [(base, base + 80), (base + 1000, base + 1080)]
    assert physical_spans(view[:, :5]) == [(base, base + 40), (base + 1000, base + 1040)]


def test_span_helpers():
    assert merge_spans([(5, 9), (0, 3), (3, 5)]) == [(0, 9)]
    assert clip_to((0, 100), [(10, 20), (50, 200)]) == [(10, 20), (50, 100)]
