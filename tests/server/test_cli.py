"""`kvboost-server` as a user starts it: flags, the startup line, serving, shutting down."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from kvboost.server.__main__ import main, serve_command


def test_console_script_entry_points_exist():
    assert callable(main) and callable(serve_command)
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("kvboost-server") == "kvboost.server.__main__:main"


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> list[str]:
    """stdout lines up to the first matching pattern (the last one), read on a helper thread so a silent
    child cannot hang us."""
    seen: list[str] = []
    found = threading.Event()

    def reader() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if re.search(pattern, line):
                found.set()
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    assert found.is_set(), f"no line matching {pattern!r} within {timeout}s (exit code {proc.poll()}): {seen}"
    return seen


def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Ctrl-C, as a user stops it; killed only if it does not exit in time."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _device_lines(device: torch.device) -> tuple[str, ...]:
    """What the startup lines say of the device: its name (cuda:0) and, off the CPU, why the Linear products are
    the model's own (model/cpu_linear.py: CPU BLAS only)."""
    if device.type == "cpu":
        return ("model 'tiny-cli' on cpu",)
    return (f"model 'tiny-cli' on {device}", f"Linear products: off: the model is on {device.type} (CPU BLAS only)")


def test_server_command_starts_prints_address_serves_and_stops(tiny_model_dir, device, tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", KVBOOST_API_KEY="")
    cmd = [sys.executable, "-m", "kvboost.server", "--model", str(tiny_model_dir), "--host", "127.0.0.1",
           "--port", "0", "--served-model-name", "tiny-cli", "--max-batch-size", "1", "--kv-cache-bits", "8",
           "--recompute-strategy", "cacheblend", "--batch-window-ms", "5", "--max-queue", "4",
           "--memory-budget-bytes", str(48 << 20), "--disk-cache-dir", str(tmp_path / "kv"),
           "--disk-budget-bytes", str(40 << 20),
           "--log-level", "warning", "--device", str(device)]  # the suite's device (the default: best available)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = _read_until(proc, r"listening on http://", timeout=120)
        url = re.search(r"http://127\.0\.0\.1:(\d+)", lines[-1])
        assert url, lines
        base = url.group(0)
        # Before it listens, the server says what it runs on and how it will batch, and has warmed up.
        start = "".join(lines)
        for expected in (*_device_lines(device), "float32", "context 1,024 tokens", "loaded in ",
                         "warmed up in ", "K/V cache: memory budget ", "budget 48 MiB",  # CUDA: the host tier's
                         f"disk {tmp_path / 'kv'} budget 40 MiB",
                         "chunks of 128 tokens stored at 8 bits",
                         "batching: one request at a time; queue 4"):
            assert expected in start, start
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.1)
        stats = httpx.get(base + "/v1/stats", timeout=5).json()
        # The warm-up ran through the worker, in baseline mode: nothing was stored by it.
        assert stats["scheduler"]["completed"] == 1 and stats["cache"]["requests_by_mode"] == {"baseline": 1}
        assert stats["cache"]["chunks_written"] == 0 and stats["cache"]["tiers"]["memory"]["entries"] == 0
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny-cli", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, temperature=0)
        assert r.model == "tiny-cli" and r.choices[0].message.content is not None
        assert r.model == client.models.list().data[0].id
        stats = httpx.get(base + "/v1/stats", timeout=5).json()
        assert stats["cache"]["namespace"].endswith("b8")  # --kv-cache-bits reached the engine
    finally:
        _stop(proc)
    assert proc.returncode is not None


def test_warm_files_are_stored_before_listening(tiny_model_dir, tmp_path):
    """--warm: the first request that starts with the warmed system prompt reuses it (no first-request spike)."""
    system = "You answer questions about the river. " * 12
    (tmp_path / "system.txt").write_text(system)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", KVBOOST_API_KEY="")
    cmd = [sys.executable, "-m", "kvboost.server", "--model", str(tiny_model_dir), "--port", "0",
           "--served-model-name", "tiny-warm", "--chunk-size", "16", "--warm", str(tmp_path / "system.txt"),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = _read_until(proc, r"listening on http://", timeout=120)
        assert any("warmed 1 prompt(s)" in line for line in lines), lines
        base = re.search(r"http://127\.0\.0\.1:(\d+)", lines[-1]).group(0)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model="tiny-warm", max_tokens=2, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "Where is it?"}])
        assert r.usage.prompt_tokens_details.cached_tokens >= 0.7 * r.usage.prompt_tokens
    finally:
        _stop(proc)


@pytest.mark.parametrize("flags, named", [(["--kv-cache-bits", "3"], "kv_cache_bits"),
                                          (["--chunk-size", "32", "--chunk-boundary-window", "16"],
                                           "chunk_boundary_window"),
                                          (["--warm", "/nonexistent/system.txt"], "/nonexistent/system.txt"),
                                          (["--warm", "BADJSON"], "messages"),
                                          (["--fast-path", "fast"], "fast_path")])
def test_bad_flags_exit_with_a_message(tiny_model_dir, tmp_path, flags, named):
    if "BADJSON" in flags:
        bad = tmp_path / "bad.json"
        bad.write_text('{"role": "system"}')  # an object, not a list of messages
        flags = [str(bad) if f == "BADJSON" else f for f in flags]
    proc = subprocess.run([sys.executable, "-m", "kvboost.server", "--model", str(tiny_model_dir), *flags,
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert named in proc.stderr


@pytest.mark.parametrize("flag", ["--model", "--host", "--port", "--recompute-strategy", "--kv-cache-bits",
                                  "--batch-window-ms", "--disk-cache-dir", "--redis-url", "--api-key",
                                  "--served-model-name", "--max-queue", "--chunk-size", "--chunk-boundary-window",
                                  "--content-reuse", "--fast-path", "--memory-budget-bytes", "--disk-budget-bytes",
                                  "--redis-ttl-s", "--device-kv-budget-bytes", "--device-kv-max-tokens"])
def test_help_lists_the_documented_flags(flag):
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command()(serve_command)
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}).output
    assert flag in out
