"""vllm-ascend's source, to read, never installed: its sdist from PyPI (the simple index names it;
`pip download` cannot take it, its metadata build needs the NPU toolchain), checked against the
pinned digest and unpacked under the cache. Prints the source directory.
Usage: ascend_src.py [cache dir]   (default ~/.cache/pd-operator/vllm-ascend)"""
from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "0.23.0.post1"
SHA256 = "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1"
INDEX = "https://pypi.org/simple"
KEEP = ("vllm_ascend/distributed/kv_transfer/", "examples/disaggregated_prefill_v1/", "vllm_ascend/__init__.py")


def main() -> None:
    cache = Path(sys.argv[1] if len(sys.argv) > 1 else Path.home() / ".cache/pd-operator/vllm-ascend")
    out = cache / f"vllm_ascend-{VERSION}"
    done = out / ".complete"
    if not done.exists():
        req = urllib.request.Request(f"{INDEX}/vllm-ascend/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            files = json.load(r)["files"]
        name = f"vllm_ascend-{VERSION}.tar.gz"
        url = next(f["url"] for f in files if f["filename"] == name)
        with urllib.request.urlopen(url, timeout=600) as r:
            data = r.read()
        got = hashlib.sha256(data).hexdigest()
        if got != SHA256:
            raise SystemExit(f"{name}: sha256 {got}, pinned {SHA256}")
        prefix = f"vllm_ascend-{VERSION}/"
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(KEEP)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(out, members=members, filter="data")
        done.write_text(SHA256 + "\n")
    print(out)


if __name__ == "__main__":
    main()
