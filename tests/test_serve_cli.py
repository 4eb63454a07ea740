"""``v41-serve``'s command line (issue 18; README.md "Serving"): the seed's launch command -- an Aphrodite command
for DeepSeek-V4.1 -- starts v41, and each flag of other engines' commands is honoured, refused with a clear
error, or accepted with one warning (``serve/compat.py``), never ignored silently."""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest

from serve_helpers import serve
from v41.chat import encode_messages
from v41.kernels.dispatch import kernel_mode
from v41.serve import compat
from v41.serve.cli import main
from v41.serve.cli_options import build_parser
from v41.testing.tiny import make_tiny

pytestmark = pytest.mark.timeout(180)

SEED_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
# The flags of the seed's command (`aphrodite serve deepseek-ai/DeepSeek-V4.1-Flash-1017 ...`), unchanged:
# (flag, value or None for a switch).
SEED_FLAGS = [
    ("--served-model-name", "deepseek-v41"), ("--trust-remote-code", None), ("--tokenizer-mode", "deepseek_v41"),
    ("--tool-call-parser", "deepseek_v41"), ("--enable-auto-tool-choice", None),
    ("--reasoning-parser", "deepseek_v41"), ("--tensor-parallel-size", "4"), ("--moe-backend", "b12x"),
    ("--attention-backend", "B12X_DSV41"), ("--engram-config", '{"cpu_offload":true}'), ("--kv-cache-dtype", "fp8"),
    ("--max-model-len", "1048576"), ("--max-num-seqs", "8"), ("--max-num-batched-tokens", "4096"),
    ("--max-cudagraph-capture-size", "64"), ("--enable-prefix-caching", None),
    ("--attention-config", '{"indexer_tp_shard_min_rows":2048}'), ("--gpu-memory-utilization", "0.90"),
    ("--no-enable-flashinfer-autotune", None), ("--mm-encoder-tp-mode", "data"),
    ("--hf-overrides", '{"head_dtype":"float32"}'),
    ("--speculative-config", '{"method":"dspark","num_speculative_tokens":7,"draft_tensor_parallel_size":4,'
                             '"moe_backend":"b12x","attention_backend":"B12X_DSV41","draft_sample_method":'
                             '"probabilistic","rejection_sample_method":"block","enable_adaptive_verification":false}'),
]
# Parsed and checked by v41-serve; the seed's K = 7 exceeds the tiny checkpoint's DSpark block of 5 and its draft
# TP 4 needs TP 4, so the CPU run of the seed's command leaves it out.
SEED_CHECKPOINT_ONLY = ("--speculative-config",)
NO_MEANING_WARNINGS = ("--moe-backend b12x", "--attention-backend B12X_DSV41", "indexer_tp_shard_min_rows=2048",
                       "--no-enable-flashinfer-autotune", "--mm-encoder-tp-mode data")


def argv(flags, drop=(), **replace) -> list[str]:
    """``flags`` as argv, without the flags in ``drop``, values replaced by ``replace`` (``max_model_len=...``)."""
    out = []
    for flag, value in flags:
        if flag in drop:
            continue
        out.append(flag)
        if value is not None:
            out.append(replace.get(flag.lstrip("-").replace("-", "_"), value))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("serve-cli"), "deepseek_v41")


def opts(*args: str) -> argparse.Namespace:
    return build_parser().parse_args(list(args))


# -- the seed's command ----------------------------------------------------------------------------------------
def test_seed_command_passes_every_flag_check(caplog):
    seed = opts(SEED_MODEL, *argv(SEED_FLAGS))
    assert seed.kv_cache_dtype == "fp8" and seed.max_model_len == 1048576
    with caplog.at_level(logging.WARNING, logger="v41.serve"):
        settings = compat.resolve(seed, "cpu")  # raises FlagError for a flag v41 refuses
    assert settings.enable_auto_tool_choice and settings.chat_revision == "v41"


def test_async_output_processing_is_on_unless_turned_off(ckpt):
    """--async-output-proc is the default; --no-async-output-proc gives the synchronous step (EngineArgs)."""
    from v41.serve.cli import engine_args

    assert engine_args(opts(str(ckpt)), ckpt, "cpu").async_output_proc
    assert not engine_args(opts(str(ckpt), "--no-async-output-proc"), ckpt, "cpu").async_output_proc


def test_seed_speculative_config_parses_and_its_kernel_keys_warn(caplog):
    seed = dict(SEED_FLAGS)["--speculative-config"]
    with caplog.at_level(logging.WARNING, logger="v41.serve"):
        compat.check_speculative_config(opts("--speculative-config", seed).speculative_config)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "moe_backend b12x" in warnings[0] and "attention_backend B12X_DSV41" in warnings[1]
    with pytest.raises(compat.FlagError, match="--speculative-config: moe_backend 'fastest' unknown"):
        compat.check_speculative_config({"num_speculative_tokens": 1, "moe_backend": "fastest"})


def test_seed_command_starts_v41_and_answers_a_chat(ckpt, tmp_path):
    # Replaced: the model (tiny checkpoint, positional as in the seed), TP 1, the CPU, and the context (1,048,576
    # tokens of the tiny model's CPU cache are ~4.5 GB); dropped: the speculative config the tiny drafter cannot run.
    flags = argv(SEED_FLAGS, drop=SEED_CHECKPOINT_ONLY, tensor_parallel_size="1", max_model_len="4096")
    with serve(ckpt, tmp_path / "serve.log", *flags, positional=True) as srv:
        assert [m["id"] for m in httpx.get(f"{srv.base}/v1/models").json()["data"]] == ["deepseek-v41"]
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
        for body in ({"messages": msgs}, {"messages": msgs, "tools": tools}):  # tools: tool_choice auto
            r = httpx.post(f"{srv.base}/v1/chat/completions", timeout=60,
                           json={"model": "deepseek-v41", "max_tokens": 8, "temperature": 0, **body})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] in ("stop", "length", "tool_calls")
            assert isinstance(choice["message"]["content"] or "", str)
        log = srv.log()
    for words in NO_MEANING_WARNINGS:  # one warning each
        assert sum(words in line and "WARNING" in line for line in log.splitlines()) == 1, (words, log)
    assert "--trust-remote-code: accepted" in log
    assert "KV cache (fp8 records)" in log, log  # the seed's --kv-cache-dtype fp8


def test_format_flags_choose_the_served_chat_format(ckpt, tmp_path):
    flags = ["--tokenizer-mode", "deepseek_v4", "--tool-call-parser", "deepseek_v4", "--served-model-name", "m"]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    with serve(ckpt, tmp_path / "serve.log", *flags) as srv:
        got = httpx.post(f"{srv.base}/tokenize", json={"messages": msgs}).json()["tokens"]
    assert got == encode_messages(ckpt, msgs, revision="v4-original") != encode_messages(ckpt, msgs)


# -- errors before anything starts -----------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--tool-call-parser", "hermes"], ["--tool-call-parser 'hermes': unknown", "deepseek_v41, deepseek_v4"]),
    (["--reasoning-parser", "deepseek_r1"], ["--reasoning-parser 'deepseek_r1': unknown"]),
    (["--tokenizer-mode", "mistral"], ["--tokenizer-mode 'mistral': unknown", "auto"]),
    (["--tokenizer-mode", "deepseek_v41", "--tool-call-parser", "deepseek_v4"], ["different chat formats"]),
    (["--moe-backend", "nope"], ["--moe-backend 'nope': unknown", "auto, torch, triton", "b12x"]),
    (["--attention-backend", "triton"], ["cannot run on cpu", "available: auto, torch"]),
    (["--attention-config", '{"indexer_rows": 1}'], ["unknown key 'indexer_rows'", "indexer_tp_shard_min_rows"]),
    (["--attention-config", '{"indexer_tp_shard_min_rows": 0}'], ["must be a positive integer"]),
    (["--hf-overrides", '{"tie_word_embeddings": true}'], ["'tie_word_embeddings' is not a config field"]),
    (["--hf-overrides", '{"head_dtype": "bfloat16"}'], ["head_dtype: v41 computes the LM head in float32"]),
    (["--max-cudagraph-capture-size", "0"], ["max_cudagraph_capture_size must be positive"]),
    (["--kv-cache-dtype", "fp8", "--model-impl", "paged"], ["kv_cache_dtype='fp8' runs on the fast model"]),
    (["--speculative-config", "{}"], ["--speculative-config", "num_speculative_tokens is required"]),
    (["--engram-config", '{"cpu_offload": true, "hot": 1}'], ["--engram-config", "unknown key 'hot'", "hot_rows"]),
    (["--engram-config", '{"transfer": "dma"}'], ["--engram-config", "transfer must be one of 'uva', 'copy'"]),
    (["--speculative-config", '{"num_speculative_tokens": 2, "k": 1}'], ["unknown key 'k'", "num_speculative_tokens"]),
    (["--speculative-config", '{"num_speculative_tokens": 7}'], ["num_speculative_tokens 7 exceeds",
                                                                  "dspark_block_size 5"]),
    (["--speculative-config", '{"num_speculative_tokens": 5, "draft_tensor_parallel_size": 4}'],
     ["draft_tensor_parallel_size 4 must be 1 or the target's tensor_parallel_size (1)"]),
])
def test_bad_flags_exit_2_naming_the_flag(ckpt, capsys, monkeypatch, args, words):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main([str(ckpt), "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_unknown_kv_cache_dtype_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--kv-cache-dtype", "fp8_e4m3"])
    assert e.value.code == 2 and "invalid choice: 'fp8_e4m3'" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--hf-overrides", "{oops"], ["--attention-config", "[1]"],
                                  ["--speculative-config", "3"]])
def test_json_flags_must_be_json_objects(args, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(args)
    assert exc.value.code == 2 and args[0] in capsys.readouterr().err


def test_the_model_positionally_or_with_model_but_not_two_different_ones(ckpt, capsys):
    assert main(["a/b", "--model", "c/d"]) == 2
    assert "given twice" in capsys.readouterr().err
    assert opts(str(ckpt)).model_tag == str(ckpt) and opts("--model", "x").model == "x"


# -- what the accepted flags decide ----------------------------------------------------------------------------
def test_format_names_choose_the_revision():
    assert compat.chat_revision(opts()) is None
    assert compat.chat_revision(opts("--tokenizer-mode", "auto")) is None
    assert compat.chat_revision(opts("--reasoning-parser", "deepseek_v41", "--tool-call-parser", "deepseek_v41")) \
        == "v41"
    assert compat.chat_revision(opts("--tool-call-parser", "deepseek_v4")) == "v4-original"


def test_backend_flags_select_v41_kernel_paths(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level(logging.WARNING, logger="v41.serve"):
        env = compat.kernel_env(opts("--moe-backend", "b12x", "--attention-backend", "torch"), "cpu")
    assert env == {"V41_MOE_KERNELS": "auto", "V41_ATTENTION_KERNELS": "torch"}
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["--moe-backend b12x"]
    assert compat.kernel_env(opts(), "cpu") == {}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("V41_KERNELS", "auto")
    assert (kernel_mode("moe"), kernel_mode("attention"), kernel_mode()) == ("auto", "torch", "auto")
    monkeypatch.setenv("V41_MOE_KERNELS", "fast")
    with pytest.raises(ValueError, match="V41_MOE_KERNELS must be one of"):
        kernel_mode("moe")


def test_flags_without_meaning_warn_once_each(caplog):
    args = opts("--no-enable-flashinfer-autotune", "--mm-encoder-tp-mode", "data", "--trust-remote-code",
                "--attention-config", '{"indexer_tp_shard_min_rows": 2048}', "--enable-auto-tool-choice")
    with caplog.at_level(logging.INFO, logger="v41.serve"):
        settings = compat.resolve(args, "cpu")
    assert settings == compat.PeerSettings(None, {}, True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and any("--no-enable-flashinfer-autotune" in w for w in warnings)
    assert compat.resolve(opts(), "cpu") == compat.PeerSettings(None, {}, False)
