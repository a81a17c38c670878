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

from kvboost.server.__main__ import main, serve_command


def test_console_script_entry_points_exist():
    assert callable(main) and callable(serve_command)
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("kvboost-server") == "kvboost.server.__main__:main"


def _read_line(proc: subprocess.Popen, pattern: str, timeout: float) -> str:
    """The first stdout line matching pattern, read on a helper thread so a silent child cannot hang us."""
    found: list[str] = []

    def reader() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if re.search(pattern, line):
                found.append(line)
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    assert found, f"no line matching {pattern!r} within {timeout}s (exit code {proc.poll()})"
    return found[0]


def test_server_command_starts_prints_address_serves_and_stops(tiny_model_dir):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", KVBOOST_API_KEY="")
    cmd = [sys.executable, "-m", "kvboost.server", "--model", str(tiny_model_dir), "--host", "127.0.0.1",
           "--port", "0", "--served-model-name", "tiny-cli", "--max-batch-size", "1", "--kv-cache-bits", "8",
           "--recompute-strategy", "cacheblend", "--batch-window-ms", "5", "--max-queue", "4",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = _read_line(proc, r"listening on http://", timeout=120)
        url = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert url, line
        base = url.group(0)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny-cli", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, temperature=0)
        assert r.model == "tiny-cli" and r.choices[0].message.content is not None
        assert r.model == client.models.list().data[0].id
        stats = httpx.get(base + "/v1/stats", timeout=5).json()
        assert stats["cache"]["namespace"].endswith("b8")  # --kv-cache-bits reached the engine
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode is not None


@pytest.mark.parametrize("flags, named", [(["--kv-cache-bits", "3"], "kv_cache_bits"),
                                          (["--chunk-size", "32", "--chunk-boundary-window", "16"],
                                           "chunk_boundary_window")])
def test_bad_flags_exit_with_a_message(tiny_model_dir, flags, named):
    proc = subprocess.run([sys.executable, "-m", "kvboost.server", "--model", str(tiny_model_dir), *flags,
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert named in proc.stderr


@pytest.mark.parametrize("flag", ["--model", "--host", "--port", "--recompute-strategy", "--kv-cache-bits",
                                  "--batch-window-ms", "--disk-cache-dir", "--redis-url", "--api-key",
                                  "--served-model-name", "--max-queue", "--chunk-size", "--chunk-boundary-window",
                                  "--content-reuse"])
def test_help_lists_the_documented_flags(flag):
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command()(serve_command)
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}).output
    assert flag in out
