"""Version ranges as data, read from package metadata without importing the package.

vLLM's version decides which class defines each hook (see DESIGN.md's table), so every
patch declares the range it was written and tested for. Versions come from
``importlib.metadata``; nothing here imports vLLM.

Dev and local builds: ``0.26.1.dev12+g0123abc`` is a snapshot of the branch that becomes
0.26.1, so it is compared by its release part, ``(0, 26, 1)``. Pre-releases
(``0.27.0rc1``) likewise count as the release they precede.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")

Release = tuple[int, ...]


def parse_release(version: str) -> Release:
    """``'0.26.1.dev12+g0abc'`` -> ``(0, 26, 1)``; raises ValueError on garbage."""
    match = _RELEASE.match(version)
    if not match:
        raise ValueError(f"cannot read a release number from version {version!r}")
    parts = tuple(int(p) for p in match.group(1).split("."))
    return parts + (0,) * (3 - len(parts)) if len(parts) < 3 else parts


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None if it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class VersionRange:
    """``[minimum, below)`` over release numbers, e.g. ``VersionRange("0.24", "0.31")``."""

    minimum: str
    below: str

    def contains(self, version: str) -> bool:
        release = parse_release(version)
        return parse_release(self.minimum) <= release < parse_release(self.below)

    def __str__(self) -> str:
        return f">={self.minimum},<{self.below}"

