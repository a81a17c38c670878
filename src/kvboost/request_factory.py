"""RequestFactory: the keyword API turned into validated Requests for every path."""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from .config import EngineConfig
from .decoding.factory import resolve_speculation
from .decoding.grammar import OutputFormat, parse_output_format
from .decoding.speculative import SpeculativeParams
from .errors import InvalidRequestError
from .prompting import Messages, check_token_ids, encode_prompt
from .request import Request
from .results import GenerationMode
from .sampling import SamplingParams

# Per-row options generate_batch / generate_many accept (the sampling ones are shared by every row).
_ROW_OPTIONS = {"mode", "temperature", "top_p", "top_k", "min_p", "do_sample", "stop", "seed", "cache_salt",
                "content_reuse", "response_format", "regex", "grammar", "logprobs", "speculative",
                "num_speculative_tokens", "prompt_lookup_max_ngram", "prompt_lookup_min_ngram", "frequency_penalty",
                "presence_penalty", "repetition_penalty", "logit_bias"}


class RequestFactory:
    def __init__(self, config: EngineConfig, model, tokenizer, max_context: int | None, eos_token_ids: set[int]):
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.max_context, self.eos_token_ids = max_context, eos_token_ids
        self.has_draft = False  # set by the engine once its draft model is loaded
        self._grammars = None  # decoding.grammar.GrammarCompiler, built at the first output format
        self._grammars_lock = threading.Lock()

    def encode(self, prompt: str | Messages | None = None, messages: Messages | None = None,
               add_generation_prompt: bool = True, input_ids: Sequence[int] | None = None,
               chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids for a raw prompt, chat messages (the chat template) or input_ids (checked against the vocab)."""
        return encode_prompt(self.tokenizer, self.model.get_input_embeddings().num_embeddings, prompt, messages,
                             add_generation_prompt, input_ids, chat_template_kwargs)

    def tenant(self, cache_salt: str | None) -> str | None:
        """A request's tenant: its own cache_salt, else the engine's default (EngineConfig.cache_salt)."""
        return cache_salt if cache_salt is not None else self.config.cache_salt

    def make_request(self, ids: Sequence[int], params: SamplingParams, prompt_text: str | None = None, *,
                     mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE, cache_salt: str | None = None,
                     content_reuse: bool | None = None, return_logits: bool = False,
                     t_start: float | None = None, output_format: OutputFormat | None = None,
                     speculative: SpeculativeParams | str | None = "default") -> Request:
        """A validated Request from token ids; ContextLengthError if prompt plus max_new_tokens exceeds the context."""
        self.check_logit_bias(params)
        request = Request(list(ids), params, prompt_text, self.tenant(cache_salt), GenerationMode.parse(mode),
                          self.config.content_reuse if content_reuse is None else content_reuse, return_logits,
                          time.perf_counter() if t_start is None else t_start,
                          self.grammars.prepare(output_format) if output_format is not None else None,
                          speculative if isinstance(speculative, SpeculativeParams) else
                          self.speculation(speculative))
        request.check_context(self.max_context)
        return request

    def check_logit_bias(self, params: SamplingParams) -> None:
        """InvalidRequestError for a logit_bias token id the model has no logit for."""
        if not params.logit_bias:
            return
        vocab = self.vocab_size
        outside = sorted(t for t in params.logit_bias if t >= vocab)
        if outside:
            raise InvalidRequestError(f"logit_bias token id(s) {outside[:5]} outside the vocabulary "
                                      f"(0..{vocab - 1})", "logit_bias")

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits (the tokenizer's vocabulary plus any padding rows)."""
        head = self.model.get_output_embeddings()
        return getattr(head, "out_features", None) or self.model.config.get_text_config().vocab_size

    @property
    def grammars(self):
        """The GrammarCompiler (LRU-cached); StructuredOutputUnavailableError without the structured extra."""
        if self._grammars is None:
            from .decoding.grammar import GrammarCompiler

            with self._grammars_lock:  # not self.lock: a server thread must not wait for a running generation
                if self._grammars is None:
                    self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def speculation(self, speculative: str | None = "default", num_speculative_tokens: int | None = None,
                    prompt_lookup_max_ngram: int | None = None, prompt_lookup_min_ngram: int | None = None,
                    prediction: str | Sequence[int] | None = None) -> SpeculativeParams | None:
        """A request's speculation resolved against EngineConfig (None: off); drafts come from `prediction` first."""
        return resolve_speculation(self.config, self.has_draft, speculative, num_speculative_tokens,
                                   prompt_lookup_max_ngram, prompt_lookup_min_ngram, self.prediction_ids(prediction))

    def prediction_ids(self, prediction: str | Sequence[int] | None) -> list[int]:
        """Token ids of a predicted output (text without special tokens, or ids checked like input_ids)."""
        if prediction is None:
            return []
        if isinstance(prediction, str):
            return list(self.tokenizer(prediction, add_special_tokens=False)["input_ids"]) if prediction else []
        return check_token_ids(prediction, self.model.get_input_embeddings().num_embeddings, "prediction")

    def request(self, prompt: str | Messages | None = None, max_new_tokens: int = 64, *,
                messages: Messages | None = None, input_ids: Sequence[int] | None = None,
                mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, do_sample: bool | None = None,
                stop: str | Sequence[str] | None = None, seed: int | None = None, cache_salt: str | None = None,
                content_reuse: bool | None = None, return_logits: bool = False, response_format=None,
                regex: str | None = None, grammar: str | None = None, logprobs: int | None = None,
                speculative: str | None = "default", num_speculative_tokens: int | None = None,
                prompt_lookup_max_ngram: int | None = None, prompt_lookup_min_ngram: int | None = None,
                frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repetition_penalty: float = 1.0,
                logit_bias: dict[int, float] | None = None, prediction: str | Sequence[int] | None = None,
                chat_template_kwargs: dict | None = None) -> Request:
        """The keyword API as a Request, from prompt (as-is), messages (chat template) or input_ids."""
        t0 = time.perf_counter()
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, do_sample=do_sample, seed=seed, stop=stop, logprobs=logprobs,
                                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                repetition_penalty=repetition_penalty, logit_bias=logit_bias)
        fmt = parse_output_format(response_format, regex, grammar)
        mode = GenerationMode.parse(mode)
        spec = self.speculation(speculative, num_speculative_tokens, prompt_lookup_max_ngram, prompt_lookup_min_ngram,
                                prediction)
        ids = self.encode(prompt, messages, input_ids=input_ids, chat_template_kwargs=chat_template_kwargs)
        text = prompt if isinstance(prompt, str) else None  # decoded only when the result is built (not in TTFT)
        return self.make_request(ids, params, text, mode=mode, cache_salt=cache_salt, content_reuse=content_reuse,
                                 return_logits=return_logits, t_start=t0, output_format=fmt, speculative=spec)

    def batch(self, prompts, input_ids, max_new_tokens: int, options: dict) -> list[Request]:
        """One Request per prompt, from exactly one of `prompts` and `input_ids`, with the same options; every row's
        TTFT counts from now."""
        t0 = time.perf_counter()
        if (prompts is None) == (input_ids is None):
            raise InvalidRequestError("pass one of prompts or input_ids", "prompts")
        name, items = ("prompts", prompts) if prompts is not None else ("input_ids", input_ids)
        if not isinstance(items, (list, tuple)) or not items:
            raise InvalidRequestError(f"{name} must be a non-empty list", name)
        unknown = set(options) - _ROW_OPTIONS
        if unknown:
            raise TypeError(f"unexpected option(s) for a batch: {', '.join(sorted(unknown))}")
        key = "prompt" if prompts is not None else "input_ids"  # each item as request()'s argument of that name
        requests = [self.request(max_new_tokens=max_new_tokens, **{key: item}, **options) for item in items]
        for request in requests:
            request.t_start = t0
        return requests
