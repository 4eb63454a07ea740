"""Tests for the ``v41`` command line (``v41.cli``); the shipped embedded model is tested in test_embedded_model.py.

``main`` runs in-process. Generations stay short (16 tokens).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import v41
from v41.cli import main
from v41.testing.tokenizer_files import TOKENIZER_DIR, load_tiny_tokenizer


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` → (exit status, stdout, stderr)."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module", params=["deepseek_v41", "deepseek_v4"])
def tiny_dir(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    assert main(["init-tiny", str(path), "--arch", request.param]) == 0
    return path


def generate(capsys, model: Path, *extra: str) -> str:
    rc, out, err = run_cli(capsys, "generate", "--model", str(model), "--prompt", "Hello, world",
                           "--max-tokens", "16", *extra)
    assert rc == 0, err
    assert out.endswith("\n")
    return out


# -- init-tiny / generate -------------------------------------------------------------------------------
def test_init_tiny_prints_path(capsys, tmp_path):
    rc, out, _ = run_cli(capsys, "init-tiny", str(tmp_path / "m"), "--arch", "deepseek_v4", "--seed", "3")
    assert rc == 0
    assert out.strip() == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file()
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()


def test_generate_produces_text(capsys, tiny_dir):
    assert generate(capsys, tiny_dir).strip()


def test_greedy_is_deterministic(capsys, tiny_dir):
    assert generate(capsys, tiny_dir) == generate(capsys, tiny_dir)


def test_sampling_is_reproducible_per_seed(capsys, tiny_dir):
    a = generate(capsys, tiny_dir, "--temperature", "1.0", "--seed", "7")
    b = generate(capsys, tiny_dir, "--temperature", "1.0", "--seed", "7")
    c = generate(capsys, tiny_dir, "--temperature", "1.0", "--seed", "8")
    assert a == b
    assert a != c


def test_generate_deployed_float64(capsys, tiny_dir):
    assert generate(capsys, tiny_dir, "--numerics", "deployed", "--dtype", "float64").strip()


def test_generate_embedded_default(capsys):
    rc, out, err = run_cli(capsys, "generate", "--prompt", "def main(", "--max-tokens", "8", "--temperature", "0")
    assert rc == 0, err
    assert out.strip()  # the completion alone (the prompt is not echoed)


def test_version(capsys):
    rc, out, _ = run_cli(capsys, "--version")
    assert rc == 0
    assert v41.__version__ in out
    assert "profile=" in out


# -- errors: `v41: error: ...`, status 2, no traceback ---------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "{tmp}/missing", "--prompt", "hi"], "not found"),
    (["generate", "--model", "{bad}", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--model", "{bad}", "--prompt", ""], "--prompt"),
    (["generate", "--model", "{bad}", "--prompt", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "--model", "{bad}", "--prompt", "hi"], ""),
    (["init-tiny", "{file}"], ""),
])
def test_errors_exit_2(capsys, tmp_path, argv, message):
    bad = tmp_path / "bad"  # has a tokenizer but no config or weights
    bad.mkdir()
    shutil.copyfile(TOKENIZER_DIR / "tokenizer.json", bad / "tokenizer.json")
    (tmp_path / "file").write_text("not a directory")
    argv = [a.format(tmp=tmp_path, bad=bad, file=tmp_path / "file") for a in argv]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2
    assert err.startswith("v41: error: ")
    assert message in err
    assert "Traceback" not in err


@pytest.fixture
def broken_copy(tiny_dir, tmp_path):
    """A fresh copy of the module's tiny checkpoint, to break."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))


def _missing_tokenizer(path: Path) -> str:
    (path / "tokenizer.json").unlink()
    return "tokenizer.json"


def _corrupt_config(path: Path) -> str:
    (path / "config.json").write_text('{"model_type": "deepseek_v4')
    return str(path / "config.json")


def _missing_config(path: Path) -> str:
    (path / "config.json").unlink()
    return str(path / "config.json")


def _corrupt_generation_config(path: Path) -> str:
    (path / "generation_config.json").write_text("{")
    return str(path / "generation_config.json")


def _index_without_weight_map(path: Path) -> str:
    (path / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 1}}')
    return "model.safetensors.index.json"


def _f16_tensor(path: Path) -> str:
    import json

    from safetensors.torch import load_file, save_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"]["norm.weight"]
    tensors = load_file(str(shard))
    tensors["norm.weight"] = tensors["norm.weight"].half()
    save_file(tensors, str(shard))
    return "norm.weight: stored as F16"


@pytest.mark.parametrize("breaker", [_missing_tokenizer, _corrupt_config, _missing_config,
                                     _corrupt_generation_config, _index_without_weight_map, _f16_tensor])
def test_broken_checkpoint_errors_exit_2(capsys, broken_copy, breaker):
    needle = breaker(broken_copy)
    rc, out, err = run_cli(capsys, "generate", "--model", str(broken_copy), "--prompt", "hi", "--max-tokens", "2")
    assert rc == 2, err
    assert err.startswith("v41: error: ") and err.count("\n") == 1
    assert "Traceback" not in err and "[Errno" not in err
    assert needle in err
    assert out == ""


def test_bad_config_field_exits_2_naming_the_field(capsys, broken_copy):
    import json

    raw = json.loads((broken_copy / "config.json").read_text())
    (raw.get("text_config") or raw)["hidden_size"] = "abc"
    (broken_copy / "config.json").write_text(json.dumps(raw))
    rc, _, err = run_cli(capsys, "generate", "--model", str(broken_copy), "--prompt", "hi")
    assert rc == 2
    assert err.startswith("v41: error: hidden_size: ") and "Traceback" not in err
