"""Live servers on 127.0.0.1 (uvicorn in a background thread) for the openai-SDK tests."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvboost import KVBoost
from kvboost.server import BackgroundServer, ServerSettings, create_app

from ..tiny_models import make_tiny_model

TINY_NAME = "tiny-llama"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A random 3-layer llama with SmolLM2's tokenizer (and chat template), saved like any --model folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir, device):
    return KVBoost.from_pretrained(str(tiny_model_dir), chunk_size=16, device=str(device))  # on --device


@pytest.fixture(scope="session")
def patchable_engine(tiny_model_dir, device):
    """tiny_engine without a fast path: every forward calls model.forward, so a test that replaces it (to fail or
    block) takes effect on every device. tiny_engine's runner (CUDA graphs on CUDA) replays steps captured at
    load, which never call model.forward."""
    engine = KVBoost.from_pretrained(str(tiny_model_dir), chunk_size=16, device=str(device), fast_path="off")
    assert engine.runner is None
    return engine


class Live:
    """A running server: its URL, app state (scheduler, metrics) and ready-made clients."""

    def __init__(self, srv: BackgroundServer, app):
        self.srv = srv
        self.app = app
        self.url = srv.base_url
        self.state = app.state.kvboost

    @property
    def scheduler(self):
        return self.state.scheduler

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120.0, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0)

    def complete_at_once(self, prompts: list[str], max_tokens: list[int]) -> list[str]:
        """Greedy completions of every prompt, each from its own client thread, all sent at once."""
        import threading

        got: list[str] = [""] * len(prompts)

        def ask(i: int) -> None:
            got[i] = self.client().completions.create(model=TINY_NAME, prompt=prompts[i], max_tokens=max_tokens[i],
                                                      temperature=0).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.scheduler.queue_depth() or self.scheduler.active_count():
            assert time.monotonic() < deadline, f"server still busy: {self.scheduler.snapshot()}"
            time.sleep(0.02)


@contextlib.contextmanager
def live_server(engine, **settings) -> Iterator[Live]:
    settings.setdefault("served_model_name", TINY_NAME)
    app = create_app(engine, ServerSettings(**settings))
    with BackgroundServer(app) as srv:
        yield Live(srv, app)


@pytest.fixture(scope="module")
def start_server() -> Callable:
    return live_server


@pytest.fixture(scope="module")
def server(tiny_engine, tiny_model_dir) -> Iterator[Live]:
    """The default server: continuous batching (when BatchRunner is installed), tiny model."""
    with live_server(tiny_engine, model=str(tiny_model_dir)) as live:
        yield live


@pytest.fixture
def client(server) -> openai.OpenAI:
    return server.client()
