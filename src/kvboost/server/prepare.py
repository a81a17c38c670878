"""From a validated OpenAI request to what the worker needs: token ids, SamplingParams, prompt text. Everything a client
can get wrong is found here, before queueing, and answered as an HTTP 400 with OpenAI's error body."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..decoding.grammar import OutputFormat, StructuredOutputUnavailableError, parse_output_format
from ..errors import ContextLengthError, InvalidRequestError
from ..prompting import check_template_kwargs
from ..results import GenerationMode
from ..sampling import SamplingParams
from .errors import APIError, invalid, openai_param, unsupported
from .extensions import guided_format, refuse_unsupported
from .schema import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequest
from .settings import ServerSettings
from .tools import render_messages, setup_tools

_FALLBACK_MAX_TOKENS = 4096  # chat without max_tokens on a model that declares no context size
MAX_N = 16  # choices per request


@dataclass
class Prepared:
    ids: list[int]
    params: SamplingParams
    prompt_text: str | None  # None: decoded from ids when the result is built (not before the first token)
    stream: bool
    include_usage: bool
    n: int = 1
    output_format: OutputFormat | None = None
    tool_parse: str = "none"  # how replies are read for tool calls: server/toolcalls.py
    speculative: Any = "default"  # SpeculativeParams (a prediction, or speculation asked for); else the engine's
    predicted: bool = False  # the request had a prediction (usage reports its accepted / rejected tokens)
    mode: GenerationMode | None = None  # None: the server's
    content_reuse: bool | None = None  # None: the engine's


def prepare_chat(engine, req: ChatCompletionRequest, lock: threading.Lock) -> Prepared:
    n = _choices(req)
    extra = req.model_extra or {}
    if extra.get("functions") or extra.get("function_call"):
        raise unsupported("the deprecated functions / function_call fields are not supported; use tools and "
                          "tool_choice", "functions")
    with _bad_request(code="unsupported_parameter"):
        refuse_unsupported(extra)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    fmt = _output_format(req.response_format, extra)
    tools = setup_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if fmt is not None and tools.output_format is not None:
        raise invalid(f"response_format cannot be combined with tool_choice {tools.choice!r}: the reply follows "
                      "one format (send tool_choice 'none' to answer in the response_format)", "response_format")
    fmt = fmt or tools.output_format
    texts = [_message_text(i, m) for i, m in enumerate(req.messages)]
    prediction = _prediction_text(req.prediction)
    with _bad_request():
        template_kwargs = check_template_kwargs(extra.get("chat_template_kwargs"))
    with lock:
        template = getattr(engine.tokenizer, "chat_template", None)
        native = bool(tools.functions) and isinstance(template, str) and "tools" in template  # it renders tools
        messages = render_messages(req.messages, texts, tools, native)
        ids = _encode_with_tools(engine, messages, tools.functions, template_kwargs) if native else \
            _encode(engine, None, messages, "messages", template_kwargs=template_kwargs)
        speculative = _speculation(engine, req, prediction)
    _compile(engine, fmt)
    requested = req.max_completion_tokens or req.max_tokens
    max_tokens = _token_budget(engine, len(ids), requested, None, "messages")
    return _prepared(engine, req, ids, None, n, fmt, max_tokens, logprobs, speculative, tools.parse,
                     bool(prediction))


def prepare_completion(engine, req: CompletionRequest, settings: ServerSettings, lock: threading.Lock) -> Prepared:
    n = _choices(req)
    extra = req.model_extra or {}
    if extra.get("echo"):
        raise unsupported("echo is not supported by this server", "echo")
    if extra.get("suffix"):
        raise unsupported("suffix (insertion) is not supported by this server", "suffix")
    best_of = extra.get("best_of")
    if best_of not in (None, 1):
        raise unsupported("best_of other than 1 is not supported by this server", "best_of")
    for name in ("prediction", "chat_template_kwargs"):
        if extra.get(name) is not None:
            raise unsupported(f"{name} is a chat completions parameter", name)
    with _bad_request(code="unsupported_parameter"):
        refuse_unsupported(extra)
    prompt = req.prompt
    token_ids = None  # OpenAI also takes the prompt as token ids: [int, ...] or a one-element [[int, ...]]
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            token_ids, prompt = prompt, None
        elif len(prompt) != 1:
            raise invalid("send exactly one prompt per request" if prompt else "prompt is empty", "prompt")
        elif isinstance(prompt[0], list):
            token_ids, prompt = prompt[0], None
        else:
            prompt = prompt[0]
    with lock:
        ids = _encode(engine, prompt, None, "prompt", token_ids)
        speculative = _speculation(engine, req, None)
    # response_format is a KVBoost extension here (OpenAI's legacy endpoint has none): constrained text completion
    fmt = _output_format(extra.get("response_format"), extra)
    _compile(engine, fmt)
    max_tokens = _token_budget(engine, len(ids), req.max_tokens, settings.default_completion_tokens, "prompt")
    # The prompt text is None for token ids: decoded in the result, after the first token.
    return _prepared(engine, req, ids, prompt, n, fmt, max_tokens, req.logprobs, speculative)


# ---- pieces ------------------------------------------------------------------------------------------
def _prediction_text(prediction: dict | None) -> str | None:
    """The text of OpenAI's Predicted Outputs ({"type": "content", "content": str | parts}), or None."""
    if prediction is None:
        return None
    content = prediction.get("content")
    if prediction.get("type") != "content" or not isinstance(content, (str, list)):
        raise invalid("prediction must be {\"type\": \"content\", \"content\": text or text parts}", "prediction")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise invalid("prediction.content parts must be {\"type\": \"text\", \"text\": ...}", "prediction.content")
        content = "".join(p["text"] for p in content)
    return content


_SPECULATION_FIELDS = ("speculative", "num_speculative_tokens", "prompt_lookup_max_ngram", "prompt_lookup_min_ngram")


def _speculation(engine, req: SamplingRequest, prediction: str | None):
    """The request's speculation as generate()'s keywords take it ("default" when unset without a prediction)."""
    given = req.model_fields_set.intersection(_SPECULATION_FIELDS)
    if not prediction and not given:
        return "default"
    method = req.speculative if "speculative" in given else "default"
    with _bad_request():
        return engine.speculation(method, req.num_speculative_tokens, req.prompt_lookup_max_ngram,
                                  req.prompt_lookup_min_ngram, prediction=prediction or None)


def _output_format(response_format, extra: dict) -> OutputFormat | None:
    """response_format, or one of the guided-decoding fields other servers define (server/extensions.py)."""
    with _bad_request():
        fmt, guided = parse_output_format(response_format), guided_format(extra)
    if fmt is not None and guided is not None:
        raise invalid(f"response_format cannot be combined with {guided.param.split('.')[0]}: the reply follows one "
                      "format", guided.param.split(".")[0])
    return fmt or guided


def _choices(req: SamplingRequest) -> int:
    n = req.n or 1
    if n > MAX_N:
        raise invalid(f"n must be at most {MAX_N}", "n")
    return n


def _compile(engine, fmt: OutputFormat | None) -> None:
    """Compile now (cached for the worker), so that a bad schema is a 400 before the request is queued."""
    if fmt is None:
        return
    try:
        with _bad_request():
            engine.grammars.compile(fmt)
    except StructuredOutputUnavailableError as exc:
        raise APIError(400, f"{exc}: this server cannot constrain output", param=fmt.param,
                       code="unsupported_parameter") from None


@contextmanager
def _bad_request(param: str | None = None, code: str = "invalid_value") -> Iterator[None]:
    """An InvalidRequestError raised inside becomes a 400 naming `param` (None: the error's own, as OpenAI names it)."""
    try:
        yield
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=param or openai_param(exc.param), code=code) from None


def _encode_with_tools(engine, messages: list[dict], functions: list[dict], template_kwargs: dict) -> list[int]:
    """Through the chat template with its own tool rendering (templates that use `tools`)."""
    tools = [{"type": "function", "function": f} for f in functions]  # as HF chat templates take them
    try:
        ids = engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                   **template_kwargs)
    except Exception as exc:
        raise invalid(f"could not render the messages with tools: {type(exc).__name__}: {exc}", "messages") from None
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    return _encode(engine, None, None, "messages", [int(t) for t in ids])


def _message_text(i: int, m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise unsupported(f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                              f"messages.{i}.content")
    return "\n".join(part.text for part in m.content)


def _encode(engine, prompt: str | None, messages: list[dict] | None, param: str,
            token_ids: list[int] | None = None, template_kwargs: dict | None = None) -> list[int]:
    try:
        return engine.encode(prompt, messages, input_ids=token_ids, chat_template_kwargs=template_kwargs or None)
    except InvalidRequestError as exc:
        raise invalid(str(exc).replace("input_ids", param),
                      param if exc.param in ("prompt", "messages", "input_ids", None) else exc.param) from None
    except Exception as exc:  # e.g. a chat template that rejects this sequence of roles
        raise invalid(f"could not render the {param}: {type(exc).__name__}: {exc}", param) from None


def _token_budget(engine, n_prompt: int, requested: int | None, default: int | None, param: str) -> int:
    """max_new_tokens for this request; ContextLengthError (400) when an explicit max_tokens does not fit. default: the
    endpoint's budget when omitted (None: all the context left), lowered to what is left."""
    limit = engine.max_context
    if limit is None:  # a model that declares no context size: nothing to check against
        return requested or default or _FALLBACK_MAX_TOKENS
    if n_prompt >= limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens, but the {param} has {n_prompt} tokens "
            f"(at least one position must stay free for the reply). Shorten the {param}.", param)
    room = limit - n_prompt
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n_prompt + requested} tokens ({n_prompt} in the {param}, {requested} in the completion). "
            f"Please reduce the length of the {param} or max_tokens (at most {room} fit).", param)
    return requested


def _prepared(engine, req: SamplingRequest, ids: list[int], text: str | None, n: int, fmt: OutputFormat | None,
              max_tokens: int, logprobs: int | None, speculative: Any, tool_parse: str = "none",
              predicted: bool = False) -> Prepared:
    """What both endpoints end with: SamplingParams from the request's fields, then its mode and content_reuse (None:
    the server's / engine's) and whether a stream ends with usage."""
    with _bad_request():
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            seed=req.seed, stop=req.stop, logprobs=logprobs, frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias)
        engine.requests.check_logit_bias(params)
    with _bad_request("mode"):
        mode = None if req.mode is None else GenerationMode.parse(req.mode)
    usage = bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)
    return Prepared(ids, params, text, bool(req.stream), usage, n, fmt, tool_parse, speculative, predicted, mode,
                    req.content_reuse)
