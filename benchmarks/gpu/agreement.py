"""Per-step agreement of greedy continuations with an fp32 copy of the model (fidelity section of `kvboost bench gpu`).

"Identical to HF generate" says whether two bf16 systems made the same choices, not which one chose better. Here
each system's continuation is teacher-forced through an fp32 copy of the same weights: at step t the fp32 model
sees the prompt and the system's own first t tokens, and the step is scored by where the system's token t stands
in the fp32 distribution:

  argmax    the token is the fp32 argmax
  deficit   fp32 log-prob of the argmax minus that of the token (0 at an argmax step): how far from exact the choice was
  gap       fp32 top-1 minus top-2 log-prob: how close a tie the step was, whatever the system chose

and, where a system first differs from the reference (HF generate in the same dtype), both had seen the same
tokens, so one fp32 distribution ranks the two choices: a "duel" won by whichever token the fp32 model gives the
higher log-prob, by a margin. The reading: bf16 systems that round differently leave the argmax at near-ties
(deficits and duel margins of a few hundredths, duels split both ways); a system that is less accurate leaves it
more often or further than HF-bf16 does, and loses its duels.

The fp32 pass runs over the stored prefix's fp32 cache, cropped back after each continuation, so a step costs one
token of fp32 forward; `logits_to_keep` keeps only the continuation's positions.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvboost.model.cache_arg import cache_kwargs

# bf16 keeps 8 bits of mantissa: a logit of magnitude 1-10 is off by 0.004-0.04 after one rounding, and a forward
# rounds many times. A choice within 0.1 nats of the fp32 argmax is one that rounding alone can make.
NEAR_TIE_NATS = 0.1


def teacher_logprobs(teacher, prompt_rest: Sequence[int], tokens: Sequence[int], cache=None,
                     cached_len: int = 0) -> torch.Tensor:
    """fp32 log-probs (len(tokens), vocab): row t is the teacher's next-token distribution after the prompt and
    tokens[:t]. `cache` holds the prompt's first `cached_len` tokens (prompt_rest is the rest of the prompt) and is
    cropped back to them afterwards; without a cache prompt_rest is the whole prompt."""
    n = len(tokens)
    if n == 0:
        return torch.empty(0, 0)
    ids = list(prompt_rest) + list(tokens[:-1])
    device = next(teacher.parameters()).device
    x = torch.tensor([ids], device=device)
    extra = {} if cache is None else {**cache_kwargs(cache), "use_cache": True}
    try:
        logits = teacher(input_ids=x, logits_to_keep=n, **extra).logits[0, -n:]
    finally:
        if cache is not None and cache.get_seq_length() > cached_len:
            # A negative crop removes that many tokens: what transformers 5.17 through 5.24 all accept.
            cache.crop(cached_len - cache.get_seq_length())
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass
class Steps:
    """One continuation scored step by step (see the module doc)."""
    argmax: list[int]
    chosen: list[float]  # fp32 log-prob of the system's token
    best: list[float]  # fp32 log-prob of the argmax
    gap: list[float]  # fp32 top-1 minus top-2

    @property
    def deficits(self) -> list[float]:
        return [b - c for b, c in zip(self.best, self.chosen)]


def score_steps(logprobs: torch.Tensor, tokens: Sequence[int]) -> Steps:
    """Score `tokens` against teacher_logprobs' rows."""
    if not tokens:
        return Steps([], [], [], [])
    top = torch.topk(logprobs, 2, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(list(tokens), device=logprobs.device)[:, None])[:, 0]
    return Steps(top.indices[:, 0].tolist(), chosen.tolist(), top.values[:, 0].tolist(),
                 (top.values[:, 0] - top.values[:, 1]).tolist())


@dataclass
class Duel:
    """At the first step where a system differs from the reference (same tokens seen before it): the fp32
    log-probs of the system's token and of the reference's."""
    system: float
    reference: float

    @property
    def margin(self) -> float:
        return abs(self.system - self.reference)


def duel(logprobs: torch.Tensor, tokens: Sequence[int], reference: Sequence[int], step: int) -> Duel | None:
    """The duel at `step` (first_divergence of the two continuations), from the system's own teacher pass;
    None where one continuation ended there (EOS) or they never differ."""
    if step >= min(len(tokens), len(reference)):
        return None
    row = logprobs[step]
    return Duel(float(row[tokens[step]]), float(row[reference[step]]))


def _stats(values: Sequence[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "max": None}
    return {"mean": statistics.fmean(values), "p50": statistics.median(values), "max": max(values)}


@dataclass
class Tally:
    """One system's scored steps and duels over a row's questions; summary() is what the JSON keeps."""
    steps: int = 0
    argmax: int = 0
    near_ties: int = 0  # steps whose fp32 gap is under NEAR_TIE_NATS, whatever was chosen
    deficits: list[float] = field(default_factory=list)  # at the steps off the argmax
    duels: list[Duel] = field(default_factory=list)

    def add(self, steps: Steps, tokens: Sequence[int]) -> None:
        self.steps += len(tokens)
        self.argmax += sum(a == t for a, t in zip(steps.argmax, tokens))
        self.near_ties += sum(g < NEAR_TIE_NATS for g in steps.gap)
        self.deficits += [d for a, t, d in zip(steps.argmax, tokens, steps.deficits) if a != t]

    def summary(self) -> dict:
        off = self.deficits
        out = {"steps": self.steps, "fp32_argmax": self.argmax, "off_argmax": len(off),
               "off_argmax_near_tie": sum(d <= NEAR_TIE_NATS for d in off), "near_tie_steps": self.near_ties,
               "deficit": _stats(off), "deficits": [round(d, 5) for d in off]}
        if self.duels:
            won = sum(d.system > d.reference for d in self.duels)
            lost = sum(d.system < d.reference for d in self.duels)
            margins = [d.margin for d in self.duels]
            out["duels"] = {"n": len(self.duels), "won": won, "lost": lost, "even": len(self.duels) - won - lost,
                            "near_tie": sum(m <= NEAR_TIE_NATS for m in margins), "margin": _stats(margins)}
        return out


def merge(summaries: Sequence[dict]) -> dict:
    """Tally summaries of several rows (a dtype's total), recomputed from their counts and kept deficits."""
    t = Tally()
    for s in summaries:
        t.steps += s["steps"]
        t.argmax += s["fp32_argmax"]
        t.near_ties += s["near_tie_steps"]
        t.deficits += s["deficits"]
    out = t.summary()
    duels = [s["duels"] for s in summaries if "duels" in s]
    if duels:
        n = sum(d["n"] for d in duels)
        out["duels"] = {"n": n, **{k: sum(d[k] for d in duels) for k in ("won", "lost", "even", "near_tie")},
                        "margin": {"max": max((d["margin"]["max"] for d in duels if d["margin"]["max"] is not None),
                                              default=None)}}
    return out
