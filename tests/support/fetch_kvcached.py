#!/usr/bin/env python3
"""Fetch and unpack kvcached's source archive, without building it.

``pip download kvcached`` runs its setup.py, which needs a CUDA build of torch; the
tests only need its pure-Python modules, so this asks pip's own index machinery (the
index configured for pip on this machine) for the sdist file and unpacks it.

usage: fetch_kvcached.py VERSION DEST_DIR   -> DEST_DIR/kvcached-VERSION/
"""

from __future__ import annotations

import os
import sys
import tarfile
import tempfile


def fetch(version: str, dest: str) -> str:
    target = os.path.join(dest, f"kvcached-{version}")
    if os.path.isfile(os.path.join(target, "kvcached", "__init__.py")):
        return target
    from pip._internal.commands import create_command
    from pip._internal.network.download import Downloader

    cmd = create_command("download")
    options, _ = cmd.parse_args(["--no-deps", "--no-binary", ":all:", f"kvcached=={version}"])
    with cmd.main_context():
        session = cmd.get_default_session(options)
        finder = cmd._build_package_finder(options=options, session=session)
        for cand in finder.find_all_candidates("kvcached"):
            if str(cand.version) == version and cand.link.filename.endswith(".tar.gz"):
                with tempfile.TemporaryDirectory() as tmp:
                    path, _ = Downloader(session, progress_bar="off")(cand.link, tmp)
                    os.makedirs(dest, exist_ok=True)
                    with tarfile.open(path) as tar:
                        tar.extractall(dest, filter="data")
                return target
    raise SystemExit(f"no source archive for kvcached=={version} on the configured index")


if __name__ == "__main__":
    print(fetch(sys.argv[1], sys.argv[2]))
