"""model/weight_stream.py: the plan fits a weight budget (resident layers spread between streamed ones, slots for the
rest, refusals when even that does not fit), and an engine whose layers stream from host memory through the slots
(every wrap of the ring included) gives the all-resident engine's tokens, float or INT4, alone or batched; outside a
forward the layers hold their own weights."""
from __future__ import annotations

import time

import pytest
import torch

from kvboost import KVBoost
from kvboost.model.int4.install import quantize_linears
from kvboost.model.weight_stream import plan_streaming

from ..tiny_models import make_tiny_model

PROMPTS = ["Hello there, how are you", "Once upon a time in a land far away"]


def test_the_plan_fits_the_budget():
    ten = [100] * 10
    everything = plan_streaming(ten, 50, 50 + 1000)
    assert everything.streamed == [] and everything.resident == list(range(10))
    plan = plan_streaming(ten, 50, 50 + 2 * 100 + 4 * 100, depth=2)  # two slots, room for four layers
    assert plan.resident == [0, 3, 6, 9] and plan.streamed == [1, 2, 4, 5, 7, 8] and plan.slots == 2
    assert plan_streaming(ten, 50, 50 + 2 * 100).resident == []
    assert plan_streaming([100, 100, 100], 50, 50 + 250, depth=4).slots == 2  # what fits, not what was asked
    with pytest.raises(ValueError, match="embedding, head and norms alone"):
        plan_streaming(ten, 500, 400)
    with pytest.raises(ValueError, match="one slot of 100 bytes"):
        plan_streaming(ten, 50, 50 + 99)


def _budget(model, resident_layers: int, slots: int = 2) -> int:
    def nbytes(module: torch.nn.Module) -> int:  # parameters and buffers (INT4 codes are buffers)
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    layers = model.model.layers
    per_layer = nbytes(layers[0]) + 64 * 16  # + each tensor's alignment in a slot
    return nbytes(model) - nbytes(layers) + (slots + resident_layers) * per_layer


def _outputs(engine: KVBoost) -> list[list[int]]:
    single = [engine.generate(p, max_new_tokens=10).output_token_ids for p in PROMPTS]
    batch = [r.output_token_ids for r in engine.generate_batch(PROMPTS, max_new_tokens=8)]
    return single + batch


@pytest.mark.parametrize("layers,resident", [(3, 0), (6, 1), (6, 2)])
@pytest.mark.parametrize("int4", [False, True])
def test_a_streamed_engine_gives_the_resident_engines_tokens(tokenizer, device, layers, resident, int4):
    def model():  # built in host memory, for the device
        m = make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=layers)
        if int4:
            quantize_linears(m, group=32, device=device)
        return m

    want = _outputs(KVBoost(model(), tokenizer, device=str(device), fast_path="off"))
    streamed_model = model()
    weights = {k: v.clone() for k, v in streamed_model.state_dict().items()}
    engine = KVBoost(streamed_model, tokenizer, device=str(device),
                     weight_budget_bytes=_budget(streamed_model, resident))
    stats = engine.cache_stats()["weights"]
    assert len(stats["resident_layers"]) == resident and len(stats["streamed_layers"]) == layers - resident
    assert engine.runner is None and "weights stream" in engine.fast_path_reason
    assert stats["pinned"] or device.type != "cuda", stats["unpinned_reason"]  # page-locked, for async copies
    assert _outputs(engine) == want
    assert engine.cache_stats()["weights"]["copies"] >= layers - resident
    for name, value in engine.model.state_dict().items():  # outside a forward: each layer's own weights
        assert torch.equal(value.cpu(), weights[name]), name


@pytest.mark.parametrize("depth", [1, 3])
def test_every_prefetch_depth_gives_the_resident_engines_tokens(tokenizer, device, depth):
    model = make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=5)
    want = _outputs(KVBoost(make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=5), tokenizer,
                            device=str(device), fast_path="off"))
    engine = KVBoost(model, tokenizer, device=str(device), weight_budget_bytes=_budget(model, 0, slots=depth),
                     weight_prefetch_depth=depth)
    stats = engine.cache_stats()["weights"]
    assert stats["slots"] == depth and len(stats["streamed_layers"]) == 5
    assert _outputs(engine) == want
    short = make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=5)  # room for one slot only
    one = KVBoost(short, tokenizer, device=str(device), weight_budget_bytes=_budget(short, 0, slots=1),
                  weight_prefetch_depth=depth)
    assert one.cache_stats()["weights"]["slots"] == 1


def test_a_prefetch_depth_needs_streamed_weights(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    with pytest.raises(ValueError, match="weight_prefetch_depth applies to streamed weights"):
        KVBoost(model, tokenizer, device="cpu", weight_prefetch_depth=3)
    with pytest.raises(ValueError, match="weight_prefetch_depth"):
        KVBoost(model, tokenizer, device="cpu", weight_budget_bytes=_budget(model, 0), weight_prefetch_depth=0)


def test_static_fast_paths_are_refused_with_streamed_weights(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    for path in ("compiled", "eager"):
        with pytest.raises(ValueError, match="streamed weights run the eager path"):
            KVBoost(model, tokenizer, device="cpu", fast_path=path, weight_budget_bytes=_budget(model, 0))
    with pytest.raises(ValueError, match="weight_budget_bytes must be a positive int"):
        KVBoost(model, tokenizer, device="cpu", weight_budget_bytes=0)


@pytest.mark.parametrize("method", ["prompt_lookup", "draft"])
def test_speculation_over_a_streamed_target_is_greedy_exact(tokenizer, device, method):
    """The target streams its layers; the draft (a resident model sharing the tokenizer, or prompt lookup) proposes,
    and the target verifies the drafts in the pass that streams its weights."""
    prompt = "Copy: a b c d e f g h. Copy: a b c d e f g h. Copy: a b c"
    plain = KVBoost(make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=4), tokenizer,
                    device=str(device), fast_path="off").generate(prompt, max_new_tokens=16).output_token_ids
    target = make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=4)
    draft = make_tiny_model("llama", tokenizer, device=device, num_hidden_layers=1, seed=1) if method == "draft" \
        else None
    engine = KVBoost(target, tokenizer, device=str(device), weight_budget_bytes=_budget(target, 1), speculative=method,
                     draft_model=draft)
    out = engine.generate(prompt, max_new_tokens=16)
    assert out.output_token_ids == plain
    spec = engine.cache_stats()["speculative"]
    assert len(engine.cache_stats()["weights"]["streamed_layers"]) == 3
    if method == "draft":  # a draft model always proposes (prompt lookup may find no match in a random model's text)
        assert spec["proposals"] > 0 and spec["draft_tokens"] > 0


def test_draft_lengths_are_judged_by_the_streamed_pass(tokenizer, monkeypatch):
    """Weights that cross slowly (a delay per streamed layer copied, as a slow link adds) make every pass cost about
    the same for one token as for nine: the engine's step costs are measured on the streamed pass, and the adaptive
    policy proposes the longest drafts its twin draft model keeps."""
    from kvboost.model import weight_stream

    copy = weight_stream.WeightStreamer._copy

    def slow_copy(self, k: int) -> None:
        crossing = k not in self.where
        copy(self, k)
        if crossing:
            time.sleep(0.01)

    monkeypatch.setattr(weight_stream.WeightStreamer, "_copy", slow_copy)
    target = make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=4)
    twin = make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=4)  # same seed: every draft is kept
    engine = KVBoost(target, tokenizer, device="cpu", weight_budget_bytes=_budget(target, 1), speculative="draft",
                     draft_model=twin, num_speculative_tokens=8)
    engine.generate("Copy: a b c d e f g h. Copy: a b c", max_new_tokens=40)
    spec = engine.cache_stats()["speculative"]
    costs = spec["step_costs"]["draft"]
    assert costs["plain_step_ms"] >= 30  # three streamed layers cross in every pass
    assert spec["accepted_tokens"] == spec["draft_tokens"] >= 6 * spec["proposals"]


def _slot_addresses(model) -> dict[int, set[int]]:
    """Per decoder layer, the addresses its q_proj weight had in the forwards so far (recorded after the streamer's
    pre-hook has pointed a streamed layer at its slot)."""
    from kvboost.model.weight_stream import decoder_layers

    seen: dict[int, set[int]] = {}
    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(
            lambda module, args, i=i: seen.setdefault(i, set()).add(module.self_attn.q_proj.weight.data_ptr()))
    return seen


@pytest.mark.parametrize("layers,resident", [(5, 0), (3, 0), (6, 1)])
def test_fixed_slots_keep_each_layer_in_one_slot_and_give_the_resident_tokens(tokenizer, layers, resident):
    """Decode steps under CUDA graphs replay the copies and addresses they captured: with fixed slots each streamed
    layer always computes from the same slot (i % slots), every forward copies what it needs, and the engine gives the
    all-resident engine's tokens. The rotating ring of the eager path moves layers between slots."""
    from kvboost.model.weight_stream import stream_weights

    want = _outputs(KVBoost(make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=layers), tokenizer,
                            fast_path="off"))
    addresses = {}
    for fixed in (True, False):
        model = make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=layers)
        streamer = stream_weights(model, _budget(model, resident), torch.device("cpu"), 2, fixed_slots=fixed)
        assert streamer.fixed_slots is fixed and len(streamer.plan.streamed) == layers - resident
        seen = _slot_addresses(model)
        assert _outputs(KVBoost(model, tokenizer, fast_path="off")) == want
        slots = {s.data_ptr() for s in streamer.slots}
        streamed = [seen[i] for i in streamer.plan.streamed]
        assert all(ptrs <= slots for ptrs in streamed)
        addresses[fixed] = streamed
    assert all(len(ptrs) == 1 for ptrs in addresses[True])
    slot = [min(ptrs) for ptrs in addresses[True]]
    assert slot == [slot[i % 2] for i in range(len(slot))] and slot[0] != slot[1]  # streamed layer i: slot i % 2
    if len(slot) % 2:  # an odd count of streamed layers: the rotating ring moves them between slots
        assert any(len(ptrs) > 1 for ptrs in addresses[False])


def test_graphs_are_refused_with_streamed_weights_off_cuda(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    with pytest.raises(ValueError, match="fast_path='graphs' needs a CUDA device"):
        KVBoost(model, tokenizer, device="cpu", fast_path="graphs", weight_budget_bytes=_budget(model, 0))


def test_decode_steps_under_cuda_graphs_over_streamed_weights_give_the_resident_tokens(tokenizer, device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs over streamed weights need a CUDA device (run with --device cuda)")

    def model():
        return make_tiny_model("llama", tokenizer, device="cpu", num_hidden_layers=5)

    want = _outputs(KVBoost(model(), tokenizer, device=str(device), fast_path="graphs"))
    streamed_model = model()
    engine = KVBoost(streamed_model, tokenizer, device=str(device), fast_path="graphs",
                     weight_budget_bytes=_budget(streamed_model, 1))
    weights = engine.cache_stats()["weights"]
    assert weights["fixed_slots"] and len(weights["streamed_layers"]) == 4
    assert engine.runner is not None and engine.runner.mode == "graphs"
    assert _outputs(engine) == want
    stats = engine.cache_stats()
    assert stats["fast_path"]["replays"] > 0 and stats["fast_path"].get("capture_failures", 0) == 0
    copies = stats["weights"]["copies"]
    engine.generate(PROMPTS[0], max_new_tokens=6)  # replays copy inside the graph: the Python count stays put
    assert engine.cache_stats()["fast_path"]["replays"] > stats["fast_path"]["replays"]
    assert engine.cache_stats()["weights"]["copies"] - copies < 4 * 6
