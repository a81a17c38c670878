"""A request's chunk keys as the replicas will key its prompt, read from the HTTP body by the cluster's ingress (which
has the replicas' tokenizer and chunking recipe, not their model). Best effort: a body it cannot render keys to
nothing and is routed by load; the replica that serves it validates it as `kvboost serve` does."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..chunking import Chunker
from ..prompting import encode_prompt
from ..server.responses import input_messages
from .routing import RequestKeys

_CHAT, _COMPLETIONS, _RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"


@dataclass(frozen=True)
class Recipe:
    """How a replica keys chunks (every replica of a deployment keys them alike)."""

    tokenizer: Any
    n_vocab: int
    chunker: Chunker  # the engine's own: namespace (model, dtype, chunking, KV bits) and cuts
    content_reuse: bool  # the replicas' default for requests that do not say

    @classmethod
    def of(cls, engine) -> Recipe:
        return cls(engine.tokenizer, engine.requests.vocab_size, engine.chunker, bool(engine.config.content_reuse))


@dataclass(frozen=True)
class RequestKeying:
    recipe: Recipe

    def keys(self, path: str, body: bytes) -> RequestKeys | None:
        """None: not a generation request, or a body this cannot render (the replica answers for it)."""
        if path not in (_CHAT, _COMPLETIONS, _RESPONSES):
            return None
        try:
            request = json.loads(body)
            ids = self._prompt_ids(path, request)
        except Exception:  # anything malformed is the replica's to refuse, with its own error body
            return None
        if not ids:
            return None
        content = request.get("content_reuse", self.recipe.content_reuse)
        salt = request.get("cache_salt")
        return RequestKeys.of(self.recipe.chunker, ids, salt if isinstance(salt, str) else None, content is True)

    def _prompt_ids(self, path: str, request: dict) -> list[int] | None:
        tok, n_vocab = self.recipe.tokenizer, self.recipe.n_vocab
        if path == _COMPLETIONS:
            prompt = request.get("prompt")
            return encode_prompt(tok, n_vocab, prompt) if isinstance(prompt, str) else None
        if path == _RESPONSES:
            if request.get("previous_response_id"):
                return None  # its history lives on the replica that stored it: routed by pin (ingress)
            system = [{"role": "system", "content": request["instructions"]}] if request.get("instructions") else []
            messages = system + input_messages(request.get("input", []))
        else:
            messages = [_plain(m) for m in request.get("messages", [])]
        return encode_prompt(tok, n_vocab, messages=messages)


def _plain(message: dict) -> dict:
    """A chat message with its text parts joined, as the server renders them."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return {**message, "content": content}
