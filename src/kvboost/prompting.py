"""What the model will read: a prompt string, chat messages or token ids, as validated token ids (InvalidRequestError
with the param named, never an index error inside the model)."""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .errors import InvalidRequestError

Messages = list[dict]


# apply_chat_template arguments the caller's template variables may not override
_TEMPLATE_RESERVED = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "tools",
                      "documents", "chat_template", "continue_final_message", "return_tensors"}


def encode_prompt(tokenizer, n_vocab: int, prompt: str | Messages | None = None, messages: Messages | None = None,
                  add_generation_prompt: bool = True, input_ids: Sequence[int] | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """Exactly one of prompt (text or messages), messages or input_ids; template_kwargs go to the chat template."""
    if input_ids is not None:
        if prompt is not None or messages is not None:
            raise InvalidRequestError("pass one of prompt, messages or input_ids", "input_ids")
        return check_token_ids(input_ids, n_vocab)
    if messages is None and isinstance(prompt, list):
        prompt, messages = None, prompt
    if messages is not None:
        if prompt is not None:
            raise InvalidRequestError("pass either prompt or messages, not both", "messages")
        validate_messages(messages)
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this tokenizer has no chat template; pass a plain prompt string", "messages")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **check_template_kwargs(template_kwargs))
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
    else:
        if template_kwargs:
            raise InvalidRequestError("chat_template_kwargs apply to messages only", "chat_template_kwargs")
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string or a list of messages, got {type(prompt).__name__}",
                                      "prompt")
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        ids = tokenizer(prompt)["input_ids"]
    ids = [int(t) for t in ids]
    if not ids:
        raise InvalidRequestError("prompt tokenizes to zero tokens", "prompt")
    return ids


def check_template_kwargs(template_kwargs: dict | None) -> dict:
    """Chat-template variables: a dict of str keys that are not apply_chat_template's own arguments."""
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
        raise InvalidRequestError("chat_template_kwargs must be an object of template variables",
                                  "chat_template_kwargs")
    reserved = sorted(_TEMPLATE_RESERVED & set(template_kwargs))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    return template_kwargs


def check_token_ids(input_ids, n_vocab: int, param: str = "input_ids") -> list[int]:
    """A plain list of ints, each inside the embedding table (a 1-D or [1, n] integer tensor is accepted)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise InvalidRequestError(f"{param} must be one sequence of integer ids, got a tensor of shape "
                                      f"{tuple(input_ids.shape)} and dtype {input_ids.dtype}", param)
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (str, bytes, dict)) or not hasattr(input_ids, "__len__"):
        raise InvalidRequestError(f"{param} must be a sequence of integer token ids, got {type(input_ids).__name__}",
                                  param)
    if len(input_ids) == 0:
        raise InvalidRequestError(f"{param} is empty", param)
    # Fast path (this runs before every prefill): plain ints in range. bool is a subclass, not `int` itself.
    if all(type(t) is int for t in input_ids) and 0 <= min(input_ids) and max(input_ids) < n_vocab:
        return list(input_ids)
    ids = []  # slow path: find and name the first bad id
    for i, t in enumerate(input_ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InvalidRequestError(f"{param}[{i}] is {t!r}; token ids must be integers", param)
        if not 0 <= int(t) < n_vocab:
            raise InvalidRequestError(f"{param}[{i}] = {int(t)} is outside the model's vocabulary [0, {n_vocab})",
                                      param)
        ids.append(int(t))
    return ids


def validate_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise InvalidRequestError(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        if not isinstance(m["content"], (str, list)):
            raise InvalidRequestError(f"messages[{i}].content must be a string", "messages")
