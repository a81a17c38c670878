"""fast_path="compiled" with speculation (model/runner.py, compile_verify): the verify step compiles once, at load,
as one graph whose token axis is dynamic, and every draft count then runs it unpadded, with the ordinary path's
logits and tokens; a batch's ragged verify compiles once per model (before its first row), as one graph whose row
and token axes are dynamic."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.model.forward import forward_tokens

from ..tiny_models import make_tiny_model
from .compiled_engines import plain_and_compiled

GROUNDED = "Copy this line exactly: the quick brown fox jumps over the lazy dog and runs home. " * 5


def _unique_graphs() -> int:
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def compiled_engines(tokenizer, device):
    """(plain engine, compiled speculating engine, graphs compiled while building it): built once for the module,
    since the compile costs tens of seconds even for a tiny model; each test checks what it compiles itself."""
    before = _unique_graphs()  # the plain engine compiles nothing: counted from here, only the compiled one
    plain, fast = plain_and_compiled(tokenizer, device, speculative="prompt_lookup")
    return plain, fast, _unique_graphs() - before


def test_a_speculating_engine_compiles_its_verify_step_at_load(compiled_engines):
    plain, fast, compiled_at_load = compiled_engines
    assert compiled_at_load == 2  # the decode step and the verify step, nothing else
    stats = fast.cache_stats()["fast_path"]
    assert stats["compiled_steps"] == ["decode", "rows", "verify", "rows_verify"]
    assert "decode (one request's and a batch's) and verify steps" in stats["reason"]
    graphs = _unique_graphs()
    for text in [GROUNDED, "Tell me a story about a fox", "Essay: " + "words and more words " * 40]:
        want = plain.generate(text, max_new_tokens=20, speculative="off")
        got = fast.generate(text, max_new_tokens=20)  # the engine's default: prompt lookup
        assert got.output_token_ids == want.output_token_ids, text[:30]
    assert fast.cache_stats()["speculative"]["proposals"] > 0
    assert _unique_graphs() == graphs  # every draft count ran the graph compiled at load


def test_compiled_verifies_of_any_length_give_the_ordinary_logits(compiled_engines, tokenizer):
    """runner.verify at 2..16 tokens (the exact count, nothing padded) against one ordinary forward of the prompt and
    the tokens together: the same logits up to float rounding, and no step compiled again."""
    _, fast, _ = compiled_engines
    runner = fast.runner
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, len(tokenizer), (40,), generator=gen).tolist()
    graphs = _unique_graphs()
    with torch.inference_mode():
        runner.forward(prompt, 0)  # the prompt's K/V into the workspace (a prefill bucket)
        for n in (2, 3, 5, 9, 16):
            tokens = torch.randint(0, len(tokenizer), (n,), generator=gen).tolist()
            got = runner.verify(tokens, len(prompt)).clone()  # [n, vocab]
            assert got.shape[0] == n
            want = forward_tokens(fast.model, prompt + tokens, fast.workspace.make_cache(0), logits_to_keep=n)[0]
            torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
            runner.forward(prompt, 0)  # the ordinary forward wrote the workspace too: the prompt's K/V again
    assert _unique_graphs() == graphs


def test_compiled_batched_verifies_give_each_rows_ordinary_logits(compiled_engines, tokenizer):
    """verify_batch over rows of different lengths (each row's tokens causal among themselves, after its own keys),
    at row counts and widths run exactly (not the eager steps' 2/4/8/16 widths): each row's logits equal one
    ordinary forward of that row's tokens, and one graph serves every shape."""
    from kvboost.scheduler import Scheduler

    _, fast, _ = compiled_engines
    scheduler = Scheduler(fast, max_batch_size=4)
    scheduler.ws.ensure_rows(4)  # rows are added as a batch grows; this test drives the runner's steps itself
    steps = scheduler.runner
    gen = torch.Generator().manual_seed(2)
    graphs = None
    with torch.inference_mode():
        steps.prepare_batched_verify()  # compiled here, or by an earlier test's batch: nothing compiles after it
        graphs = _unique_graphs()
        for rows, width, kept in ((3, 3, [8, 5, 7]), (2, 5, [8, 2]), (4, 2, [3, 8, 6, 1])):
            first = torch.randint(0, len(tokenizer), (rows, 8), generator=gen).tolist()
            steps.verify_batch(first, [0] * rows)  # every row's first 8 tokens' K/V
            tokens = torch.randint(0, len(tokenizer), (rows, width), generator=gen).tolist()
            got = steps.verify_batch(tokens, kept).clone()  # rows kept different numbers of the first tokens
            assert got.shape[:2] == (rows, width) and ("rows_verify", rows, width) in steps.steps
            for i in range(rows):
                ids = first[i][:kept[i]] + tokens[i]
                want = forward_tokens(fast.model, ids, fast.workspace.make_cache(0), logits_to_keep=width)[0]
                torch.testing.assert_close(got[i], want.float(), rtol=1e-4, atol=1e-4)
    assert _unique_graphs() == graphs
    assert "compile_refusals" not in fast.cache_stats()["fast_path"]


def test_rows_verify_drafts_together_through_the_compiled_step(compiled_engines, tokenizer):
    """generate_batch of grounded prompts on the speculating compiled engine: ragged verifies run compiled, and every
    row's tokens equal plain generation's."""
    from ..prompts import text_with_tokens

    plain, fast, _ = compiled_engines
    prompts = [GROUNDED, text_with_tokens(tokenizer, 30, seed=3) + " " + GROUNDED, GROUNDED[:90]]
    want = [plain.generate(p, max_new_tokens=24, speculative="off").output_token_ids for p in prompts]
    before = fast.cache_stats()["speculative"]["batched_proposals"]
    graphs = _unique_graphs()
    got = fast.generate_batch(prompts, max_new_tokens=24)
    assert [r.output_token_ids for r in got] == want
    assert fast.cache_stats()["speculative"]["batched_proposals"] > before  # rows drafted beside each other
    assert _unique_graphs() - graphs <= 2  # at most the rows step and the batched verify, if no test compiled them


def test_without_speculation_on_the_engine_verifies_stay_eager(tokenizer, device):
    """A compiled engine that does not speculate compiles no verify step; a request that asks for speculation runs
    its verifies eagerly (padded to a bucket), with the same tokens."""
    if device.type != "cpu":
        pytest.skip("fast_path='compiled' is the CPU path (CUDA runs graphs)")
    before = _unique_graphs()
    fast = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, fast_path="compiled",
                   chunk_size=16)
    assert _unique_graphs() - before == 1 and fast.cache_stats()["fast_path"]["compiled_steps"] == ["decode", "rows"]
    plain = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, chunk_size=16)
    got = fast.generate(GROUNDED, max_new_tokens=16, speculative="prompt_lookup")
    assert got.output_token_ids == plain.generate(GROUNDED, max_new_tokens=16).output_token_ids
    assert got.draft_tokens > 0
    assert _unique_graphs() - before == 1


def test_plain_transformers_on_the_same_model_keeps_the_compiled_steps(compiled_engines, tokenizer):
    """A baseline run with the model's own products (model_own_products, as the benches run HF generate on the
    engine's model) puts the same Linear forwards back after it: no compiled step is dropped and compiled again."""
    from kvboost.model.cpu_linear import model_own_products

    plain, fast, _ = compiled_engines
    want = plain.generate(GROUNDED, max_new_tokens=12, speculative="off").output_token_ids
    assert fast.generate(GROUNDED, max_new_tokens=12).output_token_ids == want
    graphs = _unique_graphs()
    ids = torch.tensor([fast.encode(GROUNDED)])
    with torch.inference_mode(), model_own_products(fast.model):
        fast.model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert fast.generate(GROUNDED, max_new_tokens=12).output_token_ids == want
    assert _unique_graphs() == graphs


def test_a_step_dynamo_will_not_compile_runs_eagerly_and_says_so(tokenizer, device):
    """At recompile_limit 1 the verify step (a second graph of the runner's function) is refused at load: verifies
    then run eagerly with the same tokens, and cache_stats() says which steps are compiled and why not the other;
    nothing is reported compiled that is not."""
    if device.type != "cpu":
        pytest.skip("fast_path='compiled' is the CPU path (CUDA runs graphs)")
    with torch._dynamo.config.patch(recompile_limit=1):
        fast = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, fast_path="compiled",
                       chunk_size=16, speculative="prompt_lookup")
        stats = fast.cache_stats()["fast_path"]
        assert stats["compiled_steps"] == ["decode", "rows", "rows_verify"] and stats["compile_refusals"] == 1
        assert stats["failure"].startswith("verify steps run eagerly") and "recompile_limit (1)" in stats["failure"]
        plain = KVBoost(make_tiny_model("llama", tokenizer, device=device), tokenizer, chunk_size=16)
        got = fast.generate(GROUNDED, max_new_tokens=16)
        assert got.output_token_ids == plain.generate(GROUNDED, max_new_tokens=16).output_token_ids
        assert got.draft_tokens > 0 and fast.cache_stats()["fast_path"]["compile_refusals"] == 1


def test_batches_of_a_speculating_compiled_engine_reuse_its_verify_graph(compiled_engines):
    """A batch runner's steps share the model's graphs: a lone row verifying its drafts runs the verify graph
    compiled at load, and the batch's decode steps compile the rows graph once."""
    plain, fast, _ = compiled_engines
    prompts = [GROUNDED, "Tell me a story about a fox", GROUNDED[:90]]
    want = [plain.generate(p, max_new_tokens=16, speculative="off").output_token_ids for p in prompts]
    graphs = _unique_graphs()
    proposals = fast.cache_stats()["speculative"]["proposals"]
    for picked in ([0], [0, 1, 2]):
        got = fast.generate_batch([prompts[i] for i in picked], max_new_tokens=16)
        assert [r.output_token_ids for r in got] == [want[i] for i in picked]
    assert fast.cache_stats()["speculative"]["proposals"] > proposals
    assert _unique_graphs() - graphs <= 2  # the rows graph and the batched verify (unless an earlier test compiled
    # them); no other
