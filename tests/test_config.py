"""EngineConfig: options grouped by concern, flat names read through, deprecated names warned once and ignored,
every combination that cannot run refused by one table (config.RULES), and the engine's resolved plan."""
from __future__ import annotations

import warnings

import pytest

from kvboost import KVBoost
from kvboost import config as config_module
from kvboost.config import GROUPS, OWNER, RULES, EngineConfig, Environment

from .tiny_models import make_tiny_model

FINE = Environment("cpu", None, "not a CUDA device", None, None)


def test_options_are_grouped_and_read_flat():
    cfg = EngineConfig(chunk_size=32, redis_ttl_s=5, fast_path="off", speculative="prompt_lookup")
    assert (cfg.cache.chunk_size, cfg.tiers.redis_ttl_s, cfg.execution.fast_path) == (32, 5, "off")
    assert cfg.speculation.speculative == cfg.speculative == "prompt_lookup"
    assert cfg.chunk_size == 32 and cfg.memory_budget_bytes > 0  # defaulted in its group
    assert set(cfg.as_dict()) == set(GROUPS) and cfg.as_dict()["cache"]["chunk_size"] == 32
    assert all(OWNER[name] == group for group, opts in cfg.as_dict().items() for name in opts)
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig(chunk_sise=32)
    with pytest.raises(AttributeError):
        _ = cfg.no_such_option


def test_each_mode_is_checked_against_its_owners_values():
    from kvboost.kv.dtype import KV_DTYPES
    from kvboost.model.cpu_linear import CPU_LINEAR_MODES
    from kvboost.model.forward import ATTENTION_BACKENDS
    from kvboost.model.runner import FAST_PATHS

    for name, values in (("attention_backend", ATTENTION_BACKENDS), ("fast_path", FAST_PATHS),
                         ("cpu_linear", CPU_LINEAR_MODES), ("kv_dtype", KV_DTYPES)):
        for value in values:
            EngineConfig(**{name: value})
        with pytest.raises(ValueError, match=f"{name} must be one of {', '.join(values)}"):
            EngineConfig(**{name: "nonsense"})


def test_deprecated_names_warn_once_and_are_ignored(monkeypatch):
    monkeypatch.setattr(config_module, "_warned", set())
    with pytest.warns(FutureWarning, match="paged_kv=True is deprecated and ignored"):
        cfg = EngineConfig.from_kwargs(paged_kv=True, chunk_size=16)
    assert cfg.chunk_size == 16 and "paged_kv" not in OWNER
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second use does not warn again
        EngineConfig.from_kwargs(paged_kv=True)
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig(paged_kv=True)  # only the keyword API knows the old names


CUDA = Environment("cuda", None, None, None, None, has_draft_model=True)  # every fact in favour, on a GPU
CPU = Environment("cpu", None, "not a CUDA device", None, None, has_draft_model=True)


@pytest.mark.parametrize("options,bad,good,message", [
    ({"fast_path": "graphs"}, FINE, CUDA, "fast_path='graphs' needs a CUDA device"),
    ({"fast_path": "compiled"}, CUDA, CPU, "fast_path='compiled' is the CPU path"),
    ({"fast_path": "eager"}, Environment("cpu", None, None, "sliding-window attention", None), CPU,
     "fast_path='eager': sliding-window attention"),
    ({"fast_path": "graphs", "attention_backend": "sdpa"}, CUDA, None, "needs attention_backend='triton'"),
    ({"attention_backend": "triton"}, FINE, CUDA, "attention_backend='triton' needs a CUDA device"),
    ({"attention_backend": "triton"}, Environment("cuda", None, "triton is not installed", None, None), CUDA,
     "not available here: triton is not installed"),
    ({"attention_backend": "sdpa"}, Environment("cpu", "its layers call attention directly", None, None, None), CPU,
     "attention_backend='sdpa': its layers call attention directly"),
    ({"cpu_linear": "on"}, Environment("cpu", None, None, None, "the model is bfloat16"), CPU,
     "cpu_linear='on': the model is bfloat16"),
    ({"speculative": "draft"}, FINE, CPU, "speculative='draft' needs draft_model="),
    ({"kv_dtype": "bfloat16"}, Environment("cpu", "its layers call attention directly", None, None, None,
                                           dtype="float32"), CPU, "kv_dtype='bfloat16' needs KVBoost's attention"),
    ({"kv_dtype": "bfloat16", "attention_backend": "model"}, CPU, None, "here the model's own attention runs"),
])
def test_the_rules_table_refuses_what_cannot_run(options, bad, good, message):
    cfg = EngineConfig(**options)  # facts of a model and device: refused once they are known, not before
    with pytest.raises(ValueError, match=message):
        cfg.check(bad)
    if good is not None:
        cfg.check(good)


def test_rules_on_the_options_alone_refuse_as_the_config_is_made():
    with pytest.raises(ValueError, match="chunk_boundary_window must be in"):
        EngineConfig(chunk_size=16, chunk_boundary_window=8)
    EngineConfig(chunk_size=16, chunk_boundary_window=7)


def test_every_rule_names_real_options():
    assert all(name in OWNER for rule in RULES for name in rule.options)


def test_the_engine_refuses_before_building_and_reports_its_plan(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="fast_path='graphs' needs a CUDA device"):
            KVBoost(model, tokenizer, fast_path="graphs")
    engine = KVBoost(model, tokenizer, chunk_size=16)
    plan = engine.cache_stats()["plan"]
    assert plan["attention"] == engine.attention and plan["fast_path"] == (engine.runner.mode if engine.runner
                                                                           else "off")
    assert plan["kv_design"].startswith("one workspace row per running request") and plan["max_batch_size"] == 16
    assert any(line.startswith("attention: ") for line in engine.plan.lines())
