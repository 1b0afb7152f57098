#!/usr/bin/env python3
"""Download a package's source archive from the configured index WITHOUT building it.

`pip download kvcached` would run kvcached's setup.py, which needs a CUDA build of torch;
this fetches the archive only, through pip's own index configuration (pip.conf, env).

usage: fetch_sdist.py NAME VERSION DEST_DIR
"""

from __future__ import annotations

import os
import sys

from pip._internal.commands import create_command
from pip._internal.network.download import Downloader


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    name, version, dest = sys.argv[1:4]
    cmd = create_command("download")
    options, _ = cmd.parse_args(["--no-deps", "--no-binary", ":all:", "-d", dest,
                                 f"{name}=={version}"])
    with cmd.main_context():
        session = cmd.get_default_session(options)
        finder = cmd._build_package_finder(options=options, session=session)
        for cand in finder.find_all_candidates(name):
            if str(cand.version) == version and cand.link.filename.endswith((".tar.gz", ".zip")):
                os.makedirs(dest, exist_ok=True)
                path, _ = Downloader(session, progress_bar="off")(cand.link, dest)
                print(path)
                return
    sys.exit(f"no source archive found for {name}=={version}")


if __name__ == "__main__":
    main()
