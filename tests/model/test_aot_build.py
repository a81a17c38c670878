"""model/aot_build.py through the engine: fast_path="auto" on a CPU starts the decode-step package's build in a child
process that outlives the engine's process; a second engine waits for that build (no second one), decoding eagerly
meanwhile (its stepping thread giving up a core), then decodes from the package with the same greedy tokens; a later
engine loads the cached package at once; a failed build or a failing package costs nothing but speed, and is said;
no job, lock, log or partial file is left behind."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kvboost import KVBoost
from kvboost.model import aot_build

from ..tiny_models import make_tiny_model

PROMPT = "Hello there, how are you today? Tell me"


def _wait(package, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while package.building:
        assert time.monotonic() < deadline, "the package build did not finish"
        time.sleep(0.2)


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.glob("*") if not p.name.endswith(".pt2") or ".partial" in p.name)


@pytest.fixture
def aot_on(monkeypatch, aot_cache_dir):
    monkeypatch.setenv("KVBOOST_AOT", "1")
    monkeypatch.setenv("KVBOOST_CACHE_DIR", str(aot_cache_dir))
    return aot_cache_dir / "aot"


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_tiny_model("llama", tokenizer, device="cpu")


def _texts(engine: KVBoost) -> list[str]:
    return [engine.generate(PROMPT, max_new_tokens=10).text,
            *(r.text for r in engine.generate_batch([PROMPT, "Once upon a time"], max_new_tokens=6))]


def test_a_build_outlives_its_process(tokenizer, aot_on):
    for stale in aot_on.glob("*") if aot_on.exists() else []:  # built by test_aot_step.py, run first
        stale.unlink()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.dirname(__file__)))!r})
        import torch
        torch.set_num_threads({torch.get_num_threads()})  # the package key holds the thread count: this run's
        from tests.tiny_models import make_tiny_model
        from kvboost import KVBoost
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained({tokenizer.name_or_path!r})
        engine = KVBoost(make_tiny_model("llama", tok, device="cpu"), tok, device="cpu")
        assert engine.runner.package.building
        print(engine.runner.package.lock, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    lock = Path(done.stdout.strip())
    assert lock.exists() and aot_build._holder_alive(lock)  # the build goes on after its engine's process ended


def test_a_second_engine_waits_for_the_running_build_then_decodes_from_the_package(model, tokenizer, aot_on):
    want = _texts(KVBoost(model, tokenizer, device="cpu", fast_path="off"))
    threads = torch.get_num_threads()
    engine = KVBoost(model, tokenizer, device="cpu")
    package = engine.runner.package
    assert engine.runner.mode == "package" and package.step is None
    assert package.building, "no build running: test_a_build_outlives_its_process must run first"
    assert not list(aot_on.glob("*.job.pt")) or aot_build._holder_alive(package.lock)  # no second build's job
    assert "built in the background" in engine.cache_stats()["fast_path"]["reason"]
    assert engine.generate(PROMPT, max_new_tokens=10).text == want[0]  # eager meanwhile
    assert engine.cache_stats()["fast_path"].get("steps", 0) == 0
    if package.building:
        assert torch.get_num_threads() == max(1, threads - 1)  # the build has a core
    _wait(package)
    assert package.failure is None and package.step is not None and package.path.exists()
    assert _texts(engine) == want
    fast = engine.cache_stats()["fast_path"]
    assert fast["steps"] >= 9 and "AOTInductor package" in fast["decode_kernels"]
    assert torch.get_num_threads() == threads  # given back once the build ended
    assert _leftovers(aot_on) == []


def test_a_later_engine_loads_the_cached_package_at_once(model, tokenizer, aot_on):
    first = KVBoost(model, tokenizer, device="cpu")
    _wait(first.runner.package)  # built by the test above, or now
    engine = KVBoost(model, tokenizer, device="cpu")
    assert not engine.runner.package.building and engine.runner.package.step is not None
    want = KVBoost(model, tokenizer, device="cpu", fast_path="off").generate(PROMPT, max_new_tokens=10).text
    assert engine.generate(PROMPT, max_new_tokens=10).text == want
    assert engine.cache_stats()["fast_path"]["steps"] >= 9


def test_a_package_that_fails_at_a_step_is_dropped_and_the_step_runs_eagerly(model, tokenizer, aot_on):
    engine = KVBoost(model, tokenizer, device="cpu")
    package = engine.runner.package
    _wait(package)

    def broken(*args):
        raise RuntimeError("simulated kernel failure")

    package.step = broken
    want = KVBoost(model, tokenizer, device="cpu", fast_path="off").generate(PROMPT, max_new_tokens=10).text
    assert engine.generate(PROMPT, max_new_tokens=10).text == want
    assert package.step is None and "simulated kernel failure" in package.failure
    assert engine.cache_stats()["fast_path"]["package_failures"] == 1
    assert "eager" in engine.cache_stats()["fast_path"]["decode_kernels"]


def test_a_failed_build_is_said_and_the_engine_decodes_eagerly(model, tokenizer, monkeypatch, tmp_path):
    monkeypatch.setenv("KVBOOST_AOT", "1")
    monkeypatch.setenv("KVBOOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(aot_build.sys, "executable", "/bin/false")  # the child exits 1 at once
    threads = torch.get_num_threads()
    engine = KVBoost(model, tokenizer, device="cpu")
    _wait(engine.runner.package)
    package = engine.runner.package
    assert package.step is None and "exit 1" in package.failure
    want = KVBoost(model, tokenizer, device="cpu", fast_path="off").generate(PROMPT, max_new_tokens=10).text
    assert engine.generate(PROMPT, max_new_tokens=10).text == want
    assert torch.get_num_threads() == threads
    log_file = package.path.with_suffix(".log")  # a failed build keeps its log, and says where
    assert str(log_file) in package.failure and log_file.exists()
    assert _leftovers(tmp_path / "aot") == [log_file.name] and not list((tmp_path / "aot").glob("*.pt2"))


def test_the_environment_turns_packages_off_or_to_cached_only(model, tokenizer, monkeypatch, tmp_path):
    monkeypatch.setenv("KVBOOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVBOOST_AOT", "0")
    engine = KVBoost(model, tokenizer, device="cpu")
    assert engine.runner is None and "KVBOOST_AOT=0" in engine.cache_stats()["fast_path"]["reason"]
    monkeypatch.setenv("KVBOOST_AOT", "cached")
    engine = KVBoost(model, tokenizer, device="cpu")
    assert engine.runner is None and "KVBOOST_AOT=cached" in engine.cache_stats()["fast_path"]["reason"]
    assert not (tmp_path / "aot").exists() or not list((tmp_path / "aot").iterdir())
