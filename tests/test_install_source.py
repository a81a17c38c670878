"""Install hints name the source this KVBoost came from, never PyPI's `kvboost` (a different project)."""
from __future__ import annotations

from pathlib import Path

import pytest

import kvboost
from kvboost.install_source import UNKNOWN_SOURCE, extra_install_args, install_args_for, source_checkout

CLONE = Path(kvboost.__file__).resolve().parents[2]


def test_a_checkout_gets_its_own_path_editable():
    assert source_checkout() == CLONE
    assert extra_install_args(["server"]) == ["-e", f"'{CLONE}[server]'"]
    assert extra_install_args(["server", "redis"]) == ["-e", f"'{CLONE}[server,redis]'"]


@pytest.mark.parametrize(("record", "expected"), [
    ({"url": "file:///home/me/kvboost", "dir_info": {"editable": True}}, ["-e", "'/home/me/kvboost[server]'"]),
    ({"url": "file:///home/me/kvboost", "dir_info": {}}, ["'/home/me/kvboost[server]'"]),
    ({"url": "file:///home/me/my%20src", "dir_info": {}}, ["'/home/me/my src[server]'"]),
    ({"url": "https://example.org/kvboost.git", "vcs_info": {"vcs": "git", "commit_id": "abc123"}},
     ["'kvboost[server] @ git+https://example.org/kvboost.git@abc123'"]),
    ({"url": "https://example.org/kvboost-0.2.0-py3-none-any.whl", "archive_info": {}},
     ["'kvboost[server] @ https://example.org/kvboost-0.2.0-py3-none-any.whl'"]),
    (None, [f"'{UNKNOWN_SOURCE}[server]'"]),
])
def test_recorded_sources(record, expected):
    assert install_args_for(record, "server") == expected
    assert all(arg not in ("kvboost[server]", "'kvboost[server]'") for arg in install_args_for(record, "server"))
