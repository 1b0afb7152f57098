#!/usr/bin/env python3
"""Fetch and unpack kvcached's source archive, without building it.

The tests need only kvcached's pure-Python modules. ``pip download kvcached`` cannot
give them: pip prepares an sdist's metadata before saving it, and kvcached's setup.py
stops without a CUDA (or ROCm) build of torch. So this reads the package index through
its public, standard interface (the PEP 503 "simple" repository API that pip itself
uses), at the index pip is configured with (``PIP_INDEX_URL``, else ``pip config get
global.index-url``, else PyPI), downloads the archive, checks the sha256 the index
publishes, and unpacks it. Only the standard library and pip's command line are used.

usage: fetch_kvcached.py VERSION DEST_DIR   -> DEST_DIR/kvcached-VERSION/
"""

from __future__ import annotations

import hashlib
import html.parser
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

DEFAULT_INDEX = "https://pypi.org/simple"


def index_url() -> str:
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else DEFAULT_INDEX


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def sdist_link(index: str, version: str) -> tuple[str, str | None]:
    """(url, sha256 or None) of ``kvcached-VERSION.tar.gz`` on the index's project page."""
    page = index.rstrip("/") + "/kvcached/"
    with urllib.request.urlopen(page, timeout=60) as response:
        parser = _Links()
        parser.feed(response.read().decode("utf-8", "replace"))
    wanted = f"kvcached-{version}.tar.gz"
    for href in parser.hrefs:
        url = urllib.parse.urljoin(page, href)
        path, _, fragment = url.partition("#")
        if path.rsplit("/", 1)[-1] == wanted:
            digest = fragment[len("sha256="):] if fragment.startswith("sha256=") else None
            return path, digest
    raise SystemExit(f"no {wanted} on {page}")


def fetch(version: str, dest: str) -> str:
    target = os.path.join(dest, f"kvcached-{version}")
    if os.path.isfile(os.path.join(target, "kvcached", "__init__.py")):
        return target
    url, digest = sdist_link(index_url(), version)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kvcached.tar.gz")
        with urllib.request.urlopen(url, timeout=300) as response, open(path, "wb") as f:
            f.write(response.read())
        if digest is not None:
            with open(path, "rb") as f:
                actual = hashlib.sha256(f.read()).hexdigest()
            if actual != digest:
                raise SystemExit(f"{url}: sha256 {actual} does not match the index's {digest}")
        os.makedirs(dest, exist_ok=True)
        with tarfile.open(path) as tar:
            tar.extractall(dest, filter="data")
    return target


if __name__ == "__main__":
    print(fetch(sys.argv[1], sys.argv[2]))
