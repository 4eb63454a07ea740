"""``--hf-overrides`` (issue 18): fields merged into ``config.json`` before it is read, validated like the file
itself, never dropped silently (v41.config ``with_overrides``; docs/model.md §1)."""

from __future__ import annotations

import json

import pytest

from test_config import v4_flash, v41_flash
from v41.config import ConfigError, ModelConfig, load_config, with_overrides


def test_override_replaces_a_nested_text_config_field_and_a_flat_one():
    base = ModelConfig.from_dict(v41_flash())
    got = with_overrides(v41_flash(), {"sliding_window": 64, "bos_token_id": 0})
    assert got.sliding_window == 64 and base.sliding_window == 128
    assert with_overrides(v4_flash(), {"sliding_window": 64}).sliding_window == 64


def test_reference_spelling_overrides_the_hf_field():
    assert with_overrides(v41_flash(), {"window_size": 256}).sliding_window == 256


def test_object_values_merge_key_by_key():
    got = with_overrides(v41_flash(), {"rope_scaling": {"factor": 8}})
    assert got.rope_scaling.factor == 8 and got.rope_scaling.original_max_position_embeddings == 65536


def test_head_dtype_float32_is_what_v41_computes_and_other_values_are_refused():
    assert with_overrides(v41_flash(), {"head_dtype": "float32"}) == ModelConfig.from_dict(v41_flash())
    with pytest.raises(ConfigError, match="head_dtype: v41 computes the LM head in float32, got 'bfloat16'"):
        with_overrides(v41_flash(), {"head_dtype": "bfloat16"})


@pytest.mark.parametrize("overrides, match", [
    ({"tie_word_embeddings": True}, "'tie_word_embeddings' is not a config field v41 reads"),
    ({"sliding_window": "wide"}, "sliding_window: expected an integer"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ([["sliding_window", 64]], "expected a JSON object"),
])
def test_bad_overrides_are_config_errors_naming_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        with_overrides(v41_flash(), overrides)


def test_load_config_applies_overrides_to_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v41_flash()))
    assert load_config(tmp_path, {"max_position_embeddings": 4096}).max_position_embeddings == 4096
    assert load_config(tmp_path).max_position_embeddings == 1048576


def test_the_engine_runs_on_the_overridden_config(tmp_path):
    from v41.engine.llm import LLM
    from v41.testing.tiny import make_tiny

    ckpt = str(make_tiny(tmp_path, "deepseek_v41"))
    assert LLM(ckpt, hf_overrides={"max_position_embeddings": 300}, kv_cache_bytes=32 << 20).engine.max_model_len \
        == 300
    with pytest.raises(ConfigError, match="head_dtype"):
        LLM(ckpt, hf_overrides={"head_dtype": "float16"}, kv_cache_bytes=32 << 20)
