"""The README's tables are the code's: the environment variables (config.VARIABLES) and
the patch table (kvcached_pd.patches.PATCHES)."""

from __future__ import annotations

import pathlib
import re

from kvcached_pd import config
from kvcached_pd.patches import PATCHES
from kvcached_pd.testing import TEST_PATCHES

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def env_table_rows() -> list[str]:
    """The README's environment-variable table, rendered from the declared list."""
    return [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in config.VARIABLES]


def readme_table(heading: str) -> list[str]:
    """The body rows of the first table under ``## heading``."""
    section = README.read_text().split(f"\n## {heading}\n", 1)[1]
    table: list[str] = []
    for line in section.splitlines():
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    return [row for row in table[1:] if not row.startswith("| ---")]


def test_environment_table_is_the_declared_list():
    assert readme_table("Environment variables") == env_table_rows()


def test_patch_table_names_every_patch_of_the_table_and_no_other():
    rows = readme_table("How activation works")
    named = [name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])]
    assert named == [p.name for p in PATCHES]
    assert not {p.name for p in TEST_PATCHES} & set(named)


if __name__ == "__main__":  # print the table to paste into the README
    print("\n".join(env_table_rows()))
