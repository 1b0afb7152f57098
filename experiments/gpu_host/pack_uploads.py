#!/usr/bin/env python3
"""Pack a wheelhouse into the fewest upload folders of at most FOLDER_MIB each.

Files larger than a folder (torch, triton, NCCL, the slim vLLM wheel, nixl-cu13) are cut
into parts of PART_MIB named ``NAME.partNN``; then the parts and the whole files are put
into folders first-fit by decreasing size, so the tails of the big wheels share folders
with the small ones. Every folder also gets three small files, so that whichever uploads
arrive the host can say which ones did not:

- ``MANIFEST.sha256``: the sha256 of every part and whole file, as ``sha256sum`` writes it;
- ``SPLIT.sha256``: the sha256 of every file that was cut, to check it once reassembled;
- ``LAYOUT.txt``: ``upN NAME`` for every part and whole file.

usage: pack_uploads.py SRC_DIR OUT_DIR [--folder-mib 54] [--part-mib 54]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil

MIB = 1 << 20
# room left in each folder for MANIFEST.sha256, SPLIT.sha256 and LAYOUT.txt
META_RESERVE = 256 * 1024


def sha256_range(path: str, start: int = 0, length: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = os.path.getsize(path) - start if length is None else length
        while left > 0:
            chunk = f.read(min(left, 8 * MIB))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def copy_range(src: str, dst: str, start: int, length: int) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fin.seek(start)
        left = length
        while left > 0:
            chunk = fin.read(min(left, 8 * MIB))
            fout.write(chunk)
            left -= len(chunk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--folder-mib", type=float, default=54)
    ap.add_argument("--part-mib", type=float, default=None,
                    help="size of the parts of files larger than a folder (default: a folder)")
    a = ap.parse_args()
    folder = int(a.folder_mib * MIB) - META_RESERVE
    part = int((a.part_mib or a.folder_mib) * MIB)
    if part > folder:
        part = folder  # a part must fit a folder beside the three small files
    if part <= 0:
        raise SystemExit("pack_uploads.py: folders too small")

    # items: (name, source path, offset, length)
    items: list[tuple[str, str, int, int]] = []
    split: list[tuple[str, str]] = []
    for name in sorted(os.listdir(a.src)):
        path = os.path.join(a.src, name)
        size = os.path.getsize(path)
        if size <= folder:
            items.append((name, path, 0, size))
            continue
        split.append((sha256_range(path), name))
        nparts = (size + part - 1) // part
        if nparts > 100:
            raise SystemExit(f"pack_uploads.py: {name} would need {nparts} parts (> 100)")
        for i in range(nparts):
            items.append((f"{name}.part{i:02d}", path, i * part, min(part, size - i * part)))

    # first-fit decreasing
    folders: list[list[tuple[str, str, int, int]]] = []
    used: list[int] = []
    for item in sorted(items, key=lambda it: (-it[3], it[0])):
        for k, u in enumerate(used):
            if u + item[3] <= folder:
                folders[k].append(item)
                used[k] += item[3]
                break
        else:
            folders.append([item])
            used.append(item[3])

    if os.path.exists(a.out):
        shutil.rmtree(a.out)
    manifest, layout = [], []
    for k, content in enumerate(folders, start=1):
        d = os.path.join(a.out, f"up{k}")
        os.makedirs(d)
        for name, path, start, length in sorted(content):
            dst = os.path.join(d, name)
            if start == 0 and length == os.path.getsize(path):
                shutil.copyfile(path, dst)
            else:
                copy_range(path, dst, start, length)
            manifest.append(f"{sha256_range(dst)}  {name}")
            layout.append(f"up{k} {name}")
    meta = {"MANIFEST.sha256": sorted(manifest, key=lambda l: l.split("  ", 1)[1]),
            "SPLIT.sha256": [f"{s}  {n}" for s, n in split],
            "LAYOUT.txt": layout}
    for k in range(1, len(folders) + 1):
        for fname, lines in meta.items():
            with open(os.path.join(a.out, f"up{k}", fname), "w") as f:
                f.write("".join(line + "\n" for line in lines))
    for k, u in enumerate(used, start=1):
        print(f"up{k}: {len(folders[k - 1])} files, {u / MIB:.1f} MiB")
    total = sum(used)
    print(f"{len(folders)} folders for {total / MIB:.1f} MiB "
          f"(at least {-(-total // folder)} at {a.folder_mib:g} MiB each)")


if __name__ == "__main__":
    main()
