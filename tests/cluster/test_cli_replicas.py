"""`kvboost serve --replicas 2` as a user runs it: a local Ray cluster, the replicas on the command's port, every
other flag applied to each replica (warm prompts, chunk size, a disk tier of its own), Ctrl-C takes it all down."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import openai
import pytest

from ..server.test_cli import _read_until, _stop
from ..tiny_models import make_tiny_model

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")
pytestmark = pytest.mark.ray


def test_replicas_serve_on_the_commands_port_with_its_flags(tokenizer, tmp_path):
    folder = tmp_path / "tiny"
    make_tiny_model("llama", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    system = "You answer questions about the river. " * 12
    (tmp_path / "system.txt").write_text(system)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", KVBOOST_API_KEY="", KVBOOST_AOT="0")
    cmd = [sys.executable, "-m", "kvboost.server", "--replicas", "2", "--model", str(folder), "--port", "0",
           "--served-model-name", "tiny-ray", "--chunk-size", "16", "--warm", str(tmp_path / "system.txt"),
           "--disk-cache-dir", str(tmp_path / "disk"), "--device", "cpu", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = _read_until(proc, r"listening on http://", timeout=240)
        assert "2 replica(s) of 'tiny-ray'" in lines[-1], lines
        base = re.search(r"http://127\.0\.0\.1:(\d+)", lines[-1]).group(0)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        for question in ("Where is it?", "How long is it?", "Who named it?"):  # whichever replica: warmed
            r = client.chat.completions.create(
                model="tiny-ray", max_tokens=2, temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
            assert r.usage.prompt_tokens_details.cached_tokens >= 0.7 * r.usage.prompt_tokens
    finally:
        _stop(proc, timeout=90)
    assert proc.returncode == 0, proc.stdout.read() if proc.stdout else ""
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["replica-0", "replica-1"]


def test_ray_address_without_replicas_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvboost.server", "--ray-address", "auto"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--ray-address needs --replicas N" in proc.stderr
