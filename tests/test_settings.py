"""The declared settings: parsed once, every value checked, kvcached's switches read as
kvcached reads them (compared with kvcached 0.1.6's own code on the same inputs)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import re
import subprocess
import sys

import pytest

from kvcached_pd import config
from tests.support import kvcached_cpu, subproc

REPO = pathlib.Path(subproc.REPO)


@pytest.mark.parametrize("raw", ["maybe", "2", "enable", "tru"])
def test_unknown_kvcached_pd_is_a_problem_naming_the_accepted_values(raw):
    env = {"ENABLE_KVCACHED": "true", "KVCACHED_PD": raw}
    s = config.read_settings(env)
    assert s.active and s.forced is None  # armed, so that the guard can refuse it
    (problem,) = s.problems
    assert f"KVCACHED_PD={raw!r} is not a recognised value" in problem
    assert "1 (on), 0 (off" in problem and "unset" in problem


@pytest.mark.parametrize("raw,forced,active", [
    ("1", True, True), ("true", True, True), (" ON ", True, True),
    ("0", False, False), ("off", False, False), ("", None, True), (None, None, True),
])
def test_accepted_kvcached_pd_values(raw, forced, active):
    env = {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1"}
    if raw is not None:
        env["KVCACHED_PD"] = raw
    s = config.read_settings(env)
    assert (s.forced, s.active, s.problems) == (forced, active, ())


def test_every_settings_field_comes_from_one_declared_variable():
    fields = {f.name for f in dataclasses.fields(config.Settings)}
    declared = [v.field for v in config.VARIABLES]
    assert len(declared) == len(set(declared)) and set(declared) <= fields
    assert len(config.VARIABLE_NAMES) == len(set(config.VARIABLE_NAMES))


def test_every_variable_the_package_names_is_declared():
    """A new ``KVCACHED_PD_*`` read anywhere in the package must join the declared list
    (and so the doctor, the README table and the tests' clean environment)."""
    named = set()
    for path in (REPO / "kvcached_pd").rglob("*.py"):
        named |= set(re.findall(r"\b(KVCACHED_PD(?:_[A-Z]+)*)\b", path.read_text()))
    assert named and named <= set(config.VARIABLE_NAMES), sorted(named - set(config.VARIABLE_NAMES))


def test_settings_are_parsed_once_per_process(monkeypatch):
    monkeypatch.setenv("KVCACHED_PD_STAGING_MB", "64")
    first = config.settings()
    monkeypatch.setenv("KVCACHED_PD_STAGING_MB", "128")
    assert config.settings() is first and first.staging_mb == 64
    config.reset_settings_for_tests()
    assert config.settings().staging_mb == 128


def test_explicit_and_default_transport_are_told_apart():
    assert config.read_settings({"ENABLE_KVCACHED": "1"}).transport_explicit is False
    s = config.read_settings({"KVCACHED_PD_TRANSPORT": "Staged"})
    assert (s.transport, s.transport_explicit) == ("staged", True)


# -- kvcached's own switches, against kvcached 0.1.6's code ------------------------------
ENABLE = [None, "true", "TRUE", "True", "1", "yes", "on", " true", "0", "false", ""]
AUTOPATCH = [None, "1", "true", "0", "yes", "false"]
CONTIGUOUS = [None, "true", "TRUE", "1", "false", "0", "yes", "", " true"]

KVCACHED_READS = r"""
import json, os, sys, types
from tests.support import kvcached_cpu
kvcached_cpu.install_stand_ins()
import kvcached.utils as ku
from kvcached.integration.patch_base import enable_kvcached
from kvcached.integration.vllm.autopatch import _env_enabled  # vLLM is never imported here
from kvcached_pd import config

# kvcached's .pth runs its callback when vLLM is imported; call it at once instead.
fake = types.ModuleType("wrapt.importer")
fake.when_imported = lambda name: (lambda fn: fn(None) if name == "vllm" else None)
pth = open(os.path.join(kvcached_cpu.kvcached_src(), "kvcached_autopatch.pth")).read()
real_wrapt_importer = sys.modules.get("wrapt.importer")
cases = json.loads(sys.argv[1])
out = []
for enable, autopatch, contiguous in cases:
    for name, value in (("ENABLE_KVCACHED", enable), ("KVCACHED_AUTOPATCH", autopatch),
                        ("KVCACHED_CONTIGUOUS_LAYOUT", contiguous)):
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    ours = [config.kvcached_enabled(), config.kvcached_autopatch(), config.kvcached_contiguous_layout()]
    sys.modules["wrapt.importer"] = fake
    exec(pth)
    sys.modules["wrapt.importer"] = real_wrapt_importer
    theirs = [enable_kvcached(), _env_enabled(), ku._default_contiguous_layout()]
    out.append([enable, autopatch, contiguous, ours, theirs])
print(json.dumps(out))
"""


@pytest.mark.skipif(not kvcached_cpu.available(), reason="kvcached source not fetched")
def test_kvcached_switches_read_exactly_as_kvcached_reads_them():
    cases = list(itertools.product(ENABLE, AUTOPATCH, [None]))
    cases += [(None, None, c) for c in CONTIGUOUS]
    # A fresh interpreter: kvcached's modules read the environment at import, and its
    # autopatch module registers an import hook on vLLM that must not fire in pytest's.
    proc = subprocess.run(
        [sys.executable, "-c", KVCACHED_READS, json.dumps(cases)],
        env=subproc.clean_env(KVCACHED_SRC=kvcached_cpu.kvcached_src()), cwd=subproc.REPO,
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    differ = [r for r in results if r[3] != r[4]]
    assert not differ, differ
    # the readings the issue was about
    by_case = {tuple(r[:3]): r[3] for r in results}
    assert by_case[("yes", "1", None)][0] is False  # ENABLE_KVCACHED=yes is off to kvcached
    assert by_case[(None, None, "1")][2] is False  # KVCACHED_CONTIGUOUS_LAYOUT=1 is false


@pytest.mark.parametrize("name", ["KVCACHED_PD_SIDE_CHANNEL_PORT", "KVCACHED_PD_STAGING_MB",
                                  "KVCACHED_PD_READ_SPIN_US"])
@pytest.mark.parametrize("raw", ["²", "١٢", "１２", "1_0", "9" * 5000, "+5", "-0"],
                         ids=["superscript", "arabic-indic", "fullwidth", "underscore",
                              "5000 digits", "plus", "minus zero"])
def test_a_number_setting_takes_ascii_digits_only(name, raw):
    """``str.isdigit`` accepts "²", which ``int`` then refuses: the side-channel port
    raised ValueError instead of a settings problem; ``int`` also reads other scripts'
    digits and underscores as numbers."""
    s = config.read_settings({name: raw})
    assert len(s.problems) == 1 and s.problems[0].startswith(f"{name}=")


def test_the_side_channel_secret_is_read_from_its_file_and_never_shown(tmp_path):
    name = config.KVCACHED_PD_SIDE_CHANNEL_SECRET_FILE
    assert config.read_settings({}).side_channel_secret is None
    secret = tmp_path / "secret"
    secret.write_text("  " + "ab" * 16 + "\n")
    s = config.read_settings({name: str(secret)})
    assert s.side_channel_secret == b"ab" * 16 and not s.problems
    assert ("ab" * 16) not in repr(s)
    for content, problem in (("short", "holds 5 bytes"), ("x" * 5000, "more than 4096")):
        secret.write_text(content)
        s = config.read_settings({name: str(secret)})
        assert s.side_channel_secret is None and len(s.problems) == 1
        assert problem in s.problems[0] and s.problems[0].startswith(f"{name}=")
    for path, problem in ((tmp_path / "missing", "cannot be read"), (tmp_path, "not a regular")):
        s = config.read_settings({name: str(path)})
        assert len(s.problems) == 1 and problem in s.problems[0], s.problems
