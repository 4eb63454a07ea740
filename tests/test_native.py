"""Tests for the Rust extension module ``v41._native``."""

import v41
import v41._native as native

BUILD_INFO_KEYS = {"version", "profile", "target", "rustc", "git_commit"}


def test_version_matches_package():
    assert native.__version__ == v41.__version__


def test_build_info_keys_and_values():
    info = native.build_info()
    assert set(info) == BUILD_INFO_KEYS
    assert all(isinstance(v, str) and v for v in info.values())
    assert info["version"] == native.__version__
    assert info["profile"] in {"debug", "release"}
    assert info["target"].count("-") >= 2
