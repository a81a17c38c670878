"""Server settings: what the command line decides, in one validated dataclass."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..loading import EMBEDDED_MODEL, is_embedded
from ..results import GenerationMode

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what clients written for the hub model send


@dataclass
class ServerSettings:
    model: str | None = None  # path or hub id; None = the embedded SmolLM2-135M-Instruct
    served_model_name: str | None = None  # None: "SmolLM2-135M-Instruct" for the embedded model, else `model`
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every /v1 route needs "Authorization: Bearer <api_key>"
    max_queue: int = 256  # requests waiting for the worker; one more gets 429
    max_batch_size: int = 16  # rows per batch; 1 = one request at a time via generate_stream
    batch_window_ms: float = 20.0  # how long an idle worker waits for more requests to batch together
    mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE  # BASELINE turns reuse off (benchmarks)
    # /v1/completions without max_tokens (OpenAI's and vLLM's default); fewer when fewer positions are left
    default_completion_tokens: int = 16
    access_log: bool = False  # one line per request: method, path, status, ms, prompt / cached / completion tokens
    kv_events: str | None = None  # a ZMQ endpoint (tcp://*:5557) for vLLM-format KV events (server/kv_events.py)

    def __post_init__(self) -> None:
        self.mode = GenerationMode.parse(self.mode)
        for name, least in (("max_queue", 1), ("max_batch_size", 1), ("batch_window_ms", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.api_key == "":
            self.api_key = None

    @property
    def model_id(self) -> str:
        """The name /v1/models lists and responses carry."""
        if self.served_model_name:
            return self.served_model_name
        return EMBEDDED_MODEL if is_embedded(self.model) else str(self.model)

    def accepts_model(self, name: str) -> bool:
        """The served name, the --model value as given (or its resolved path); the embedded model's aliases."""
        if name == self.model_id:
            return True
        if is_embedded(self.model):
            return is_embedded(name) or name.lower() == EMBEDDED_HUB_ID.lower()
        given = str(self.model)
        if name == given:
            return True
        try:
            return Path(name).expanduser().resolve() == Path(given).expanduser().resolve() and Path(given).exists()
        except (OSError, ValueError):
            return False
