"""``kvcached-pd``: the operator's command line.

``kvcached-pd doctor`` prints the versions that matter, the environment gates, which
patches apply to the installed vLLM and why (not), the configuration problems that
would stop a kvcached + NIXL startup, and the KV registrations of running vLLM
processes. Exit status 1 when a blocking problem is found, 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvcached_pd import config
from kvcached_pd.versions import installed_version

PACKAGES = ("vllm", "kvcached", "nixl", "nixl-cu13", "nixl-cu12", "torch", "wrapt")
GATES = (
    config.ENABLE_KVCACHED,
    config.KVCACHED_AUTOPATCH,
    config.KVCACHED_CONTIGUOUS_LAYOUT,
    config.KVCACHED_PD,
    config.KVCACHED_PD_DISABLE,
    config.KVCACHED_PD_TRANSPORT,
    config.KVCACHED_PD_STAGING_MB,
    "VLLM_KV_CACHE_LAYOUT",
)


def doctor(args: argparse.Namespace) -> int:
    from kvcached_pd.checks import (
        kvcached_problems,
        layout_problems,
        patch_set_problems,
        vllm_version_problems,
    )
    from kvcached_pd.patches import PATCH_NAMES, PATCHES
    from kvcached_pd.registry import live_snapshots

    out = sys.stdout
    out.write("kvcached-pd doctor\n\nversions:\n")
    for name in PACKAGES:
        out.write(f"  {name:10s} {installed_version(name) or '-'}\n")
    out.write("\nenvironment:\n")
    for name in GATES:
        out.write(f"  {name}={os.environ.get(name, '')!s}\n")
    gate = config.gate_open()
    kvcached_on = config.kvcached_enabled()
    out.write(f"  -> kvcached-pd gate {'OPEN' if gate else 'closed'}; kvcached {'on' if kvcached_on else 'off'}\n")

    settings = config.read_settings(PATCH_NAMES)
    vllm_version = installed_version("vllm")
    out.write("\npatches:\n")
    for patch in PATCHES:
        ok, why = patch.applies(vllm_version)
        if patch.name in settings.disabled_patches:
            verdict, why = "off", f"disabled by {config.KVCACHED_PD_DISABLE}"
        else:
            verdict = "applies" if ok else "skipped"
        if args.deep and verdict == "applies":
            why += "; " + _dry_run(patch)
        out.write(f"  {patch.name:22s} {verdict:8s} {why}\n    {patch.summary}\n")

    problems: list[str] = list(settings.problems)
    if kvcached_on and args.nixl:
        problems += vllm_version_problems()
        problems += kvcached_problems()
        problems += layout_problems()
    if gate:
        problems += patch_set_problems(settings.disabled_patches)
    out.write("\nproblems:\n" if problems else "\nproblems: none\n")
    for p in problems:
        out.write(f"  BLOCKING: {p}\n")

    snapshots = list(live_snapshots())
    out.write(f"\nlive registrations ({len(snapshots)} process(es)):\n")
    for snap in snapshots:
        for reg in snap.get("registrations", []):
            out.write(
                f"  pid {snap['pid']} engine {reg['engine_id']} rank {reg['tp_rank']}: "
                f"{reg['budget_blocks']} of {reg['virtual_blocks']} blocks, "
                f"{reg['registered_bytes'] / 2**20:.1f} MiB registered\n"
            )
    return 1 if problems else 0


def _dry_run(patch) -> str:
    """Import the target and patch/unpatch it, to prove the hook points exist."""
    import importlib

    try:
        importlib.import_module(patch.target_module)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"target {patch.target_module} not importable here ({type(exc).__name__})"
    if patch.is_patched():
        return "already patched in this process"
    try:
        patch.patch()
        patch.unpatch()
    except Exception as exc:  # noqa: BLE001
        return f"DRY RUN FAILED: {type(exc).__name__}: {exc}"
    return "hook points found (dry run patched and restored)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcached-pd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_doctor = sub.add_parser("doctor", help="check versions, gates, patches and configuration")
    p_doctor.add_argument(
        "--no-nixl", dest="nixl", action="store_false",
        help="do not assume a NIXL connector (skip the NIXL-only checks)",
    )
    p_doctor.add_argument(
        "--deep", action="store_true",
        help="also import vLLM's NIXL modules and dry-run each patch",
    )
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
