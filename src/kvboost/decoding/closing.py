"""Finishing structured output inside max_new_tokens: the shortest way a grammar may still stop, found greedily, forced
once it needs every token left (finish reason "length", output parses). Every plan is checked against the grammar."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

HORIZON = 64  # tokens: the longest closing looked for (and the part of the budget where it is looked for)
CLOSING_MARGIN = 8  # tokens: closing starts this much before it must (a model's token may lengthen the closing)
CLOSING_CHARS = ('}]"0ntf[{,:' + "123456789-." + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                 + "_@+/#$%&*()<>=;!?'")


@dataclass(frozen=True)
class ClosingVocab:
    """The single-character tokens of CLOSING_CHARS, in order, and the tokenizer's encode (packs planned text)."""

    chars: tuple[tuple[str, int], ...]
    encode: Callable[[str], list[int]]


def closing_vocab(tokenizer, vocab_size: int) -> ClosingVocab:
    chars = []
    for c in CLOSING_CHARS:
        ids = tokenizer.encode(c, add_special_tokens=False)
        if len(ids) == 1 and ids[0] < vocab_size and tokenizer.decode(ids) == c:
            chars.append((c, ids[0]))
    return ClosingVocab(tuple(chars), lambda text: tokenizer.encode(text, add_special_tokens=False))


def _allowed(row, token: int) -> bool:
    """Bit `token` of an xgrammar bitmask row (int32 words)."""
    return (int(row[token >> 5]) >> (token & 31)) & 1 == 1


class ClosingPlanner:
    def __init__(self, matcher, vocab_size: int, stop_token_ids: Sequence[int], vocab: ClosingVocab):
        import xgrammar as xgr

        self.matcher = matcher
        self.stop_ids = list(stop_token_ids)
        self.encode = vocab.encode
        self.candidates = [t for _, t in vocab.chars]
        self.char_of = {t: c for c, t in vocab.chars}
        chars = dict(vocab.chars)
        self.quote, self.letter = chars.get('"'), chars.get("q")
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # its own: the constraint's holds the next mask
        self._words = self.bitmask[0].numpy()  # int32 words, a view refilled in place: read a few, copy none out

    def plan(self, limit: int) -> list[int] | None:
        """At most `limit` tokens after which the grammar may stop ([]: now), or None; the matcher is kept."""
        chars = self._characters(2 * limit)  # a text of n characters is at most n tokens, often far fewer
        if chars is None:
            return None
        if not chars:
            return []
        packed = self.encode("".join(self.char_of[t] for t in chars))
        if len(packed) < len(chars) and self._finishes(packed):
            return packed if len(packed) <= limit else None
        return chars if len(chars) <= limit else None

    def stop_token(self) -> int | None:
        """A stop token the grammar allows now, or None."""
        if not self._may_stop():
            return None
        return next((s for s in self.stop_ids if _allowed(self._words, s)), None)

    def _characters(self, limit: int) -> list[int] | None:
        out: list[int] = []
        try:
            while not self._may_stop():
                token = self._pick() if len(out) < limit else None
                if token is None or not self.matcher.accept_token(token):
                    return None
                out.append(token)
            return out
        finally:
            if out:
                self.matcher.rollback(len(out))

    def _finishes(self, tokens: list[int]) -> bool:
        """Whether the grammar takes `tokens` from here and may stop after them (the matcher is left as it was)."""
        n = 0
        try:
            for t in tokens:
                if not self.matcher.accept_token(t):
                    return False
                n += 1
            return self._may_stop()
        finally:
            if n:
                self.matcher.rollback(n)

    def _may_stop(self) -> bool:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return any(_allowed(self._words, s) for s in self.stop_ids)

    def _pick(self) -> int | None:
        row = self._words
        if self.quote is not None and self.letter is not None and _allowed(row, self.letter) \
                and _allowed(row, self.quote):
            return self.quote  # inside a string: close it
        return next((t for t in self.candidates if _allowed(row, t)), None)
