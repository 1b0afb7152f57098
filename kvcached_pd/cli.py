"""``kvcached-pd``: the operator's command line.

``kvcached-pd doctor`` prints the versions that matter, the environment gates, which
patches apply to the installed vLLM and why (not), the configuration problems that
would stop a kvcached + NIXL startup, and the KV registrations of running vLLM
processes. It reads the same settings, the same decision of what serves
(``serving.decide``) and runs the same checks as the connector guard
(``checks.startup_problems``), so it exits 1 exactly when a NIXL startup in this
environment would be refused, and 0 otherwise, including when kvcached-pd is off
(it then says that nothing will be patched).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvcached_pd import config, serving
from kvcached_pd.versions import installed_version

PACKAGES = ("vllm", "kvcached", "nixl", "nixl-cu13", "nixl-cu12", "torch", "wrapt")


def doctor(args: argparse.Namespace) -> int:
    from kvcached_pd import checks
    from kvcached_pd.patches import PATCH_NAMES, PATCHES
    from kvcached_pd.registry import live_snapshots

    out = sys.stdout
    settings = config.settings()
    vllm_version = installed_version("vllm")
    decision = serving.decide(settings, vllm_version)
    out.write("kvcached-pd doctor\n\nversions:\n")
    for name in PACKAGES:
        out.write(f"  {name:10s} {installed_version(name) or '-'}\n")

    out.write("\nenvironment (every variable kvcached-pd reads):\n")
    for var in config.VARIABLES:
        value = os.environ.get(var.name)
        shown = repr(value) if value is not None else f"unset (default: {var.default})"
        out.write(f"  {var.name:27s} {shown}\n")
    for note in _kvcached_reading_notes():
        out.write(f"  note: {note}\n")

    if not settings.active:
        out.write(f"\nkvcached-pd: OFF ({settings.gate_reason}).\n"
                  "  A vLLM started with this environment runs without kvcached-pd: nothing is "
                  "patched, nothing is refused. Not a problem unless you meant to use it: run "
                  "the doctor in the environment you serve with.\n")
    else:
        out.write(f"\nkvcached-pd: ON ({settings.gate_reason}).\n"
                  f"  transport that will serve: {decision.transport} ({decision.reason})\n"
                  f"  wire: {decision.wire} ({decision.wire_reason})\n")

    failed: dict[str, str] = {}
    out.write("\npatches:\n")
    for patch in PATCHES:
        ok, why = patch.applies(vllm_version)
        if not settings.active:
            verdict, why = "off", "kvcached-pd is off"
        elif patch.name in settings.disabled_patches and patch.name != checks.GUARD:
            verdict, why = "disabled", f"by {config.KVCACHED_PD_DISABLE}"
        elif patch.name in settings.disabled_patches:
            verdict, why = "applies", f"{config.KVCACHED_PD_DISABLE} cannot turn the guard off"
        else:
            verdict = "applies" if ok else "skipped"
        if args.deep and ok and verdict != "disabled":  # the hook points, even while off
            result = _dry_run(patch)
            if result.startswith("DRY RUN FAILED") and patch.fail_closed and settings.active:
                failed[patch.name] = result
            why += "; " + result
        out.write(f"  {patch.name:22s} {verdict:8s} {why}\n    {patch.summary}\n")

    problems = checks.startup_problems(settings, known_patches=PATCH_NAMES, nixl=args.nixl,
                                       failed=failed, vllm_version=vllm_version)
    if args.deep and settings.active:
        problems += checks.staging_memory_problems(
            settings, decision, _device_total_bytes(),
            "in all on this machine's first CUDA device")
    kvcached_refusal = (checks.kvcached_runner_problem(vllm_version,
                                                      checks.kvcached_runner_window())
                        if settings.active and settings.kvcached_enabled else None)
    if kvcached_refusal:
        out.write("\nkvcached (its own check, when vLLM's engine starts; not counted below):\n"
                  f"  WILL FAIL: {kvcached_refusal}\n")
    if problems:
        out.write("\nproblems (startup refuses a NIXL connector):\n")
        for p in problems:
            out.write(f"  BLOCKING: {p}\n")
    else:
        out.write("\nproblems: none\n")
    ignored = [] if settings.active else checks.setting_problems(settings, PATCH_NAMES)
    if ignored:
        out.write("ignored while kvcached-pd is off (they block once it is on):\n")
        for p in ignored:
            out.write(f"  - {p}\n")

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


def _kvcached_reading_notes(env=None) -> list[str]:
    """Values that read one way to a person and another to kvcached (which accepts only
    ``true``/``1``, and ``true`` alone for the layout)."""
    env = os.environ if env is None else env
    notes = []
    raw = env.get(config.ENABLE_KVCACHED)
    if raw is not None and raw.strip().lower() in config._TRUE and not config.kvcached_enabled(env):
        notes.append(f"kvcached reads {config.ENABLE_KVCACHED}={raw!r} as OFF (it accepts 'true' or '1')")
    raw = env.get(config.KVCACHED_CONTIGUOUS_LAYOUT)
    if raw is not None and raw.strip().lower() in config._TRUE and not config.kvcached_contiguous_layout(env):
        notes.append(f"kvcached reads {config.KVCACHED_CONTIGUOUS_LAYOUT}={raw!r} as FALSE "
                     "(only 'true' is true)")
    return notes


def _device_total_bytes() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


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
