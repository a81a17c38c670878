"""Where this copy of KVBoost was installed from, and the pip command that adds an extra to it: `kvboost` on PyPI is
another project, so a hint names the checkout, or the folder / URL pip recorded (PEP 610), or a placeholder."""
from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

DIST_NAME = "kvboost"
PACKAGE_DIR = Path(__file__).resolve().parent
UNKNOWN_SOURCE = "<path or URL of your KVBoost source>"


def source_checkout() -> Path | None:
    """The repository root when this package is a checkout's ``src/kvboost``, else None."""
    root = PACKAGE_DIR.parents[1]
    return root if PACKAGE_DIR.parent.name == "src" and (root / "pyproject.toml").is_file() else None


def _direct_url() -> dict[str, Any] | None:
    """pip's record of where it installed the distribution from, when that distribution is this copy."""
    try:
        dist = distribution(DIST_NAME)
        text = dist.read_text("direct_url.json")
    except PackageNotFoundError:
        return None
    if not text:
        return None
    # Another installed kvboost than the one running (a clone on PYTHONPATH over an install) says nothing here.
    if Path(str(dist.locate_file(f"{DIST_NAME}/__init__.py"))).resolve().parent != PACKAGE_DIR:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("url"), str) else None


def install_args_for(record: dict[str, Any] | None, extras: str) -> list[str]:
    """pip install's arguments for `extras` from the source in `record` (a direct_url.json; None: unknown)."""
    if record is None:
        return [shlex.quote(f"{UNKNOWN_SOURCE}[{extras}]")]
    url = record["url"]
    vcs = record.get("vcs_info")
    if isinstance(vcs, dict) and vcs.get("vcs"):
        commit = f"@{vcs['commit_id']}" if vcs.get("commit_id") else ""
        return [shlex.quote(f"{DIST_NAME}[{extras}] @ {vcs['vcs']}+{url}{commit}")]
    parsed = urlparse(url)
    if "dir_info" in record and parsed.scheme == "file":
        folder = url2pathname(parsed.path)
        editable = ["-e"] if record["dir_info"].get("editable") else []
        return [*editable, shlex.quote(f"{folder}[{extras}]")]
    return [shlex.quote(f"{DIST_NAME}[{extras}] @ {url}")]  # an archive (wheel or sdist) by URL


def extra_install_args(extras: Sequence[str]) -> list[str]:
    """The arguments of ``pip install`` that add `extras` to this KVBoost, e.g. ``["-e", "'/src/kvboost[server]'"]``."""
    joined = ",".join(extras)
    root = source_checkout()
    return ["-e", shlex.quote(f"{root}[{joined}]")] if root is not None else install_args_for(_direct_url(), joined)


def pip_install_extra(*extras: str) -> str:
    """The whole command, e.g. ``pip install -e '/src/kvboost[gpu]'``, for messages that name one extra."""
    return " ".join(["pip install", *extra_install_args(extras)])
