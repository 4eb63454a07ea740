"""Speculative-decoding options (issue 15 item 1; python/v41/engine/spec_config.py): ``speculative_config`` as a
JSON string or a dict, every bad key or value an error naming it, checked against the checkpoint's DSpark block
size, drafter and TP size before any weight loads."""

from __future__ import annotations

import dataclasses
import json

import pytest

import v41
from v41.config import load_config
from v41.engine.args import EngineArgs
from v41.engine.spec_config import SpeculativeConfig
from v41.testing.tiny import make_tiny

SEED_JSON = ('{"method":"dspark","num_speculative_tokens":7,"draft_tensor_parallel_size":4,'
             '"draft_sample_method":"probabilistic","rejection_sample_method":"block",'
             '"enable_adaptive_verification":false}')


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("spec-v41"), "deepseek_v41", weights=False)


# -- parse ------------------------------------------------------------------------------------------------------
def test_json_text_and_dict_give_the_same_config():
    from_text = SpeculativeConfig.parse(SEED_JSON)
    assert from_text == SpeculativeConfig.parse(json.loads(SEED_JSON))
    assert (from_text.num_speculative_tokens, from_text.draft_tensor_parallel_size) == (7, 4)
    assert SpeculativeConfig.parse(from_text) is from_text and SpeculativeConfig.parse(None) is None
    assert v41.SpeculativeConfig is SpeculativeConfig and v41.SpecDecodeStats(1).num_drafts == 1


def test_defaults_are_dspark_probabilistic_drafts_block_verification_and_the_target_tp():
    spec = SpeculativeConfig.parse({"num_speculative_tokens": 3})
    assert (spec.method, spec.draft_sample_method, spec.rejection_sample_method,
            spec.enable_adaptive_verification) == ("dspark", "probabilistic", "block", False)
    assert spec.draft_tp(4) == 4 and SpeculativeConfig(3, draft_tensor_parallel_size=1).draft_tp(4) == 1


@pytest.mark.parametrize("value, words", [
    ('{"num_speculative_tokens": 3, "num_lookahead_slots": 2}', ["unknown key 'num_lookahead_slots'",
                                                                "num_speculative_tokens, method"]),
    ({"method": "dspark"}, ["num_speculative_tokens is required"]),
    ({"num_speculative_tokens": 0}, ["num_speculative_tokens must be an integer >= 1, got 0"]),
    ({"num_speculative_tokens": 5.0}, ["num_speculative_tokens must be an integer", "5.0"]),
    ({"num_speculative_tokens": "5"}, ["num_speculative_tokens must be an integer", "'5'"]),
    ({"num_speculative_tokens": True}, ["num_speculative_tokens must be an integer", "True"]),
    ({"num_speculative_tokens": 3, "method": "eagle"}, ["method must be one of 'dspark'", "'eagle'"]),
    ({"num_speculative_tokens": 3, "draft_tensor_parallel_size": 0}, ["draft_tensor_parallel_size must be"]),
    ({"num_speculative_tokens": 3, "draft_tensor_parallel_size": 2.0}, ["draft_tensor_parallel_size must be"]),
    ({"num_speculative_tokens": 3, "draft_sample_method": "top_k"},
     ["draft_sample_method must be one of 'probabilistic', 'greedy'", "'top_k'"]),
    ({"num_speculative_tokens": 3, "rejection_sample_method": "typical"},
     ["rejection_sample_method must be one of 'block', 'token', 'greedy'", "'typical'"]),
    ({"num_speculative_tokens": 3, "rejection_sample_method": ["block"]}, ["rejection_sample_method must be"]),
    ({"num_speculative_tokens": 3, "enable_adaptive_verification": 1},
     ["enable_adaptive_verification must be true or false, got 1"]),
    ({"num_speculative_tokens": 3, "moe_backend": ""}, ["moe_backend must be a kernel path name"]),
    ("{oops", ["speculative_config is not valid JSON"]),
    ("[1, 2]", ["speculative_config must be a JSON object", "list"]),
])
def test_every_bad_key_or_value_is_an_error_naming_it(value, words):
    with pytest.raises(ValueError) as exc:
        SpeculativeConfig.parse(value)
    assert all(w in str(exc.value) for w in words), exc.value


# -- check against the checkpoint -----------------------------------------------------------------------------------
def test_k_up_to_the_checkpoints_block_size_passes_and_above_names_both_numbers(v41_dir):
    cfg = load_config(v41_dir)  # the tiny V4.1: dspark_block_size 5
    for k in range(1, 6):
        SpeculativeConfig(k).check(cfg, 1)
    with pytest.raises(ValueError, match=r"num_speculative_tokens 6 exceeds .*dspark_block_size 5\); use 1\.\.5"):
        SpeculativeConfig(6).check(cfg, 1)
    SpeculativeConfig(7).check(load_config(v41_dir, {"dspark_block_size": 7}), 1)  # the seed's K: not hard-coded


@pytest.mark.parametrize("arch, overrides", [("deepseek_v4", {}), ("deepseek_v41", {"dspark_block_size": 0}),
                                             ("deepseek_v41", {"num_nextn_predict_layers": 0})])
def test_a_checkpoint_without_dspark_stages_is_refused(tmp_path, arch, overrides):
    cfg = load_config(make_tiny(tmp_path, arch, weights=False), overrides or None)
    with pytest.raises(ValueError, match=f"needs a checkpoint with DSpark draft stages.*model_type {arch}"):
        SpeculativeConfig(1).check(cfg, 1)


def test_draft_tp_must_be_one_or_the_target_tp(v41_dir):
    cfg = load_config(v41_dir)
    for dtp in (None, 4):
        SpeculativeConfig(5, draft_tensor_parallel_size=dtp).check(cfg, 4)
    SpeculativeConfig(5, draft_tensor_parallel_size=1).check(cfg, 1)
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size 2 must be 1 or the target's "
                                         r"tensor_parallel_size \(4\)"):
        SpeculativeConfig(5, draft_tensor_parallel_size=2).check(cfg, 4)
    SpeculativeConfig(5, draft_tensor_parallel_size=1).check(cfg, 4)  # a replicated drafter
    SpeculativeConfig(5, draft_tensor_parallel_size=4).check(cfg, 4)


def test_adaptive_verification_passes_the_checkpoint_check(v41_dir):
    SpeculativeConfig(5, enable_adaptive_verification=True).check(load_config(v41_dir), 1)


# -- EngineArgs and the engine ------------------------------------------------------------------------------------
def test_engine_args_parse_the_option_and_it_survives_the_engine_process_json(v41_dir):
    args = EngineArgs(model=str(v41_dir), speculative_config=SEED_JSON)
    assert isinstance(args.speculative_config, SpeculativeConfig)
    args.validate()
    assert EngineArgs(**json.loads(json.dumps(dataclasses.asdict(args)))) == args  # EngineClient → engine_proc
    with pytest.raises(ValueError, match="speculative_config.draft_sample_method"):
        EngineArgs(model=str(v41_dir), speculative_config={"num_speculative_tokens": 2, "draft_sample_method": "x"})


def test_the_engine_checks_the_option_before_loading_weights(v41_dir, monkeypatch):
    import v41.engine.core as core

    def no_load(args):
        raise AssertionError("weights loaded before the speculative config was checked")

    monkeypatch.setattr(core, "make_executor", no_load)
    with pytest.raises(ValueError, match="num_speculative_tokens 6 exceeds"):
        v41.LLM(str(v41_dir), speculative_config={"num_speculative_tokens": 6})
    with pytest.raises(ValueError, match="num_speculative_tokens 6 exceeds"):
        v41.AsyncEngine(model=str(v41_dir), speculative_config='{"num_speculative_tokens": 6}')