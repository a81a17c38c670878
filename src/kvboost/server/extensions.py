"""Request fields other OpenAI-compatible servers (vLLM, SGLang, llama.cpp) added, sent through `extra_body`:
honoured where KVBoost has the feature (guided decoding, llama.cpp's json_schema / grammar), refused with a 400 where
it does not. Unknown fields are otherwise ignored, so a field that would change the reply must be known here."""
from __future__ import annotations

from typing import Any

from ..decoding.grammar import OutputFormat, json_schema_format, parse_output_format
from ..errors import InvalidRequestError

# field -> the values that change nothing (the field's default in the server that defines it)
_NO_EFFECT: dict[str, tuple] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "early_stopping": (False,),
    "stop_token_ids": ([],), "include_stop_str_in_output": (False,), "ignore_eos": (False,), "min_tokens": (0,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
    "prompt_logprobs": (), "allowed_token_ids": (), "bad_words": ([],), "add_generation_prompt": (True,),
    "continue_final_message": (False,), "add_special_tokens": (False,), "documents": (), "chat_template": (),
    "mm_processor_kwargs": (), "guided_whitespace_pattern": (),
    "logits_processors": (), "priority": (0,), "return_tokens_as_token_ids": (False,), "vllm_xargs": (),
    "typical_p": (1, 1.0), "top_a": (0, 0.0), "tfs_z": (1, 1.0), "mirostat": (0,), "mirostat_tau": (),
    "mirostat_eta": (), "dynatemp_range": (0, 0.0), "xtc_probability": (0, 0.0), "dry_multiplier": (0, 0.0),
    "n_probs": (0,),
    "return_logits": (False,),  # generate()'s: first-token logits have no place in an OpenAI reply (use logprobs)
}
# OpenAI's own fields that would change the reply and that this server does not implement: refused, never ignored.
_UNSUPPORTED = {
    "audio": "audio output is not supported by this server (text models only)",
    "web_search_options": "web search is not supported by this server",
    "reasoning_effort": "reasoning_effort is not supported with this model",
    "verbosity": "verbosity is not supported with this model",
}
_META = set("\\.^$*+?()[]{}|")
_BACKENDS = (None, "auto", "xgrammar")  # guided_decoding_backend values this server satisfies
# field -> the kind of grammar it asks for (vLLM's guided decoding; llama.cpp's json_schema and grammar)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
           "structured_outputs": "structured_outputs", "json_schema": "json", "grammar": "grammar"}


def refuse_unsupported(extra: dict[str, Any]) -> None:
    """InvalidRequestError (param = the field) for a known field set to a value changing the reply."""
    for name, harmless in _NO_EFFECT.items():
        if name in extra and extra[name] is not None and extra[name] not in harmless:
            raise InvalidRequestError(f"{name} is not supported by this server (value {extra[name]!r})", name)
    backend = extra.get("guided_decoding_backend")
    if backend not in _BACKENDS:
        raise InvalidRequestError(f"guided_decoding_backend {backend!r}: this server constrains output with xgrammar",
                                  "guided_decoding_backend")
    for name, message in _UNSUPPORTED.items():
        if extra.get(name) is not None:
            raise InvalidRequestError(message, name)
    modalities = extra.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise InvalidRequestError(f"modalities {modalities!r}: this server answers in text only (['text'])",
                                  "modalities")


def guided_format(extra: dict[str, Any]) -> OutputFormat | None:
    """vLLM's guided-decoding fields as an OutputFormat (None when none is given); at most one may be given."""
    given = [name for name in _GUIDED if extra.get(name) is not None]
    if len(given) > 1:
        raise InvalidRequestError(f"pass at most one of {', '.join(_GUIDED)} (got {', '.join(given)})", given[1])
    if not given:
        return None
    name = given[0]
    return _structured_outputs(extra[name]) if name == "structured_outputs" else _one(_GUIDED[name], extra[name], name)


def _structured_outputs(spec: Any) -> OutputFormat | None:
    # vLLM >= 0.10: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | {"json_object": true}
    if not isinstance(spec, dict):
        raise InvalidRequestError("structured_outputs must be an object", "structured_outputs")
    kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if spec.get(k) not in (None, False)]
    unknown = sorted(set(spec) - {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                                  "disable_additional_properties", "whitespace_pattern"})
    if unknown or spec.get("whitespace_pattern") is not None:
        raise InvalidRequestError(f"structured_outputs: unsupported field(s) {unknown or ['whitespace_pattern']}",
                                  "structured_outputs")
    if len(kinds) != 1:
        raise InvalidRequestError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                                  "structured_outputs")
    if kinds[0] == "json_object":
        return OutputFormat("json_object", param="structured_outputs")
    return _one(kinds[0], spec[kinds[0]], f"structured_outputs.{kinds[0]}")


def _literal(text: str) -> str:
    """text as a regex matching it literally (xgrammar's dialect escapes metacharacters only)."""
    return "".join("\\" + ch if ch in _META else ch for ch in text)


def _one(kind: str, value: Any, param: str) -> OutputFormat | None:
    if kind == "json":
        return json_schema_format(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings", param)
        value, kind = "|".join(f"({_literal(c)})" for c in value), "regex"
    fmt = parse_output_format(None, value if kind == "regex" else None, value if kind == "grammar" else None)
    return OutputFormat(fmt.kind, fmt.source, param) if fmt is not None else None
