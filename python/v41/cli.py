"""The ``v41`` command line.

``v41 init-tiny DIR --arch deepseek_v41|deepseek_v4 [--seed N]`` writes a tiny random checkpoint;
``v41 generate [--model DIR] --prompt TEXT ...`` runs the engine (Rust scheduler, paged cache, sampler) and
streams the completion (the embedded tiny V4.1 model when ``--model`` is left out); ``v41 --version`` prints the package
version, how the Rust extension was built, and which kernel path each op family takes here. Usage errors and bad inputs print ``v41: error: ...`` and
exit with status 2: bad arguments, a missing model directory, ``config.json`` or ``tokenizer.json``, a
corrupt or inconsistent config (``ConfigError``), a broken checkpoint (``CheckpointError``: malformed index,
missing/unexpected tensors, wrong shapes or dtypes, truncated shards) and other I/O errors. The library
raises these as ``ValueError`` subclasses or ``OSError``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence, TextIO

PROG = "v41"
DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")  # v41.engine.args.DTYPES (no torch import here)
NUMERICS = ("exact", "deployed")
ARCHES = ("deepseek_v41", "deepseek_v4")


class CliError(Exception):
    """A user-facing error: printed as ``v41: error: <message>``, exit status 2."""


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from . import __version__

        print(f"{PROG} {__version__}")
        try:
            from . import _native

            info = _native.build_info()
            print("native: " + " ".join(f"{k}={v}" for k, v in info.items()))
        except ImportError as e:
            print(f"native: unavailable ({e})")
        import torch

        from .kernels.dispatch import cuda_status, describe_paths, triton

        print(f"cuda kernels: {cuda_status()}")
        print(f"kernel paths: {describe_paths('cuda' if torch.cuda.is_available() else 'cpu')}")
        print(f"triton: {triton.__version__ if triton is not None else 'not installed'}")
        parser.exit(0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="DeepSeek-V4.1 / V4 inference engine.")
    p.add_argument("--version", action=_VersionAction, help="print the version and build info, then exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("init-tiny", help="write a tiny random checkpoint (random weights: gibberish)")
    s.add_argument("dir", metavar="DIR", help="output directory")
    s.add_argument("--arch", choices=ARCHES, default="deepseek_v41")
    s.add_argument("--seed", type=int, default=0, metavar="N", help="weight seed (default 0)")

    g = sub.add_parser("generate", help="generate a completion with the engine")
    g.add_argument("--model", metavar="DIR", default=None,
                   help="checkpoint directory (default: the embedded tiny V4.1 model, trained for an hour "
                        "on Python code)")
    g.add_argument("--prompt", required=True, metavar="TEXT", help="prompt text (raw, no chat template)")
    g.add_argument("--max-tokens", type=int, default=64, metavar="N", help="maximum number of new tokens (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature: sample softmax(logits / T); 0 = greedy argmax (default)")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default 0)")
    g.add_argument("--numerics", choices=NUMERICS, default="exact")
    g.add_argument("--dtype", choices=DTYPES, default="auto", help="compute dtype (auto: float32 on the CPU)")
    g.add_argument("--threads", type=int, default=1, metavar="N",
                   help="CPU threads for torch (default 1: the tiny model's small ops run fastest "
                        "single-threaded)")
    return p


def _init_tiny(args: argparse.Namespace, out: TextIO) -> None:
    from .testing.tiny import make_tiny

    path = make_tiny(Path(args.dir), args.arch, seed=args.seed)
    print(path, file=out)


def _generate(args: argparse.Namespace, out: TextIO) -> None:
    if not args.prompt:
        raise CliError("--prompt must not be empty")
    if args.max_tokens < 1:
        raise CliError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise CliError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.threads < 1:
        raise CliError(f"--threads must be at least 1, got {args.threads}")

    import torch
    from tokenizers import Tokenizer

    from .engine.llm import model_or_embedded

    model_dir = Path(model_or_embedded(args.model))
    if not model_dir.is_dir():
        raise CliError(f"model directory not found: {model_dir}")
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise CliError(f"{model_dir} has no tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # the tokenizers library raises plain Exception on a malformed file
        raise CliError(f"cannot read {tok_path}: {e}") from e
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        _stream(args, model_dir, tokenizer, out)
    finally:
        torch.set_num_threads(threads)  # main() may run in-process (tests): leave torch as it was


def _stream(args: argparse.Namespace, model_dir: Path, tokenizer, out: TextIO) -> None:
    """Run one request through the engine (paged cache, Rust scheduler, sampler) and print the completion
    as the detokenizer releases it."""
    from .engine.args import EngineArgs
    from .engine.core import EngineCore
    from .engine.prompts import encode_prompt
    from .engine.params import SamplingParams

    core = EngineCore(EngineArgs(model=str(model_dir), dtype=args.dtype, numerics=args.numerics, seed=args.seed,
                                 max_num_seqs=1, kv_cache_bytes=64 << 20))
    text, ids = encode_prompt(core, args.prompt)
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
    core.add_request("cli", ids, params, prompt=text)
    while core.has_unfinished():
        for res in core.step():  # deltas: each holds only the new text
            if res.outputs[0].text:
                out.write(res.outputs[0].text)
                out.flush()
    out.write("\n")
    out.flush()


def _message(e: Exception) -> str:
    """The user-facing text of an error: ``PATH: reason`` for OSErrors (no ``[Errno N]`` prefix)."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return str(e) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``v41`` console script. Returns 0; exits with status 2 on errors."""
    args = _parser().parse_args(argv)
    out = sys.stdout
    try:
        if args.command == "init-tiny":
            _init_tiny(args, out)
        elif args.command == "generate":
            _generate(args, out)
    except (CliError, ValueError, OSError) as e:
        out.flush()
        print(f"{PROG}: error: {_message(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        out.flush()
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
