"""The ``engramrt`` command line: the parser alone, one console script with subcommands in
vLLM's style; each command's flags and implementation live in ``engramrt/commands/``."""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

import engramrt
from engramrt.commands import (
    bench_serve,
    bench_throughput,
    check_pp,
    engram_hash,
    evaluate,
    generate,
    serve,
)

DESCRIPTION = (
    "engramrt: an inference engine for Engram + mHC language models (the DeepSeek-V4.1 family)."
)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's default in ``--help``, unless its help already speaks of it (argparse's
    own ArgumentDefaultsHelpFormatter skips options that have no help text)."""

    def _format_action(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and not any(action.default is v for v in (None, False, argparse.SUPPRESS))
            and "default" not in text
        ):
            action = copy.copy(action)
            action.help = f"{text} (default: %(default)s)".lstrip()
        return super()._format_action(action)


def _add_command(
    subparsers: Any,
    name: str,
    summary: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """``name`` with the flags ``add_arguments`` defines; ``main`` calls ``run`` with them."""
    p = subparsers.add_parser(name, help=summary, formatter_class=_DefaultsFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``bench`` with its own subcommands, as ``vllm bench`` has."""
    bench = subparsers.add_parser("bench", help="benchmark a running server (vLLM style)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_command(
        sub,
        "serve",
        "streamed /v1/completions load: TTFT, TPOT, ITL",
        bench_serve.add_arguments,
        bench_serve.run,
    )
    _add_command(
        sub,
        "throughput",
        "the engine in-process: tok/s, decode GB/s",
        bench_throughput.add_arguments,
        bench_throughput.run,
    )
    return bench


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engramrt", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"engramrt {engramrt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_command(
        sub,
        "engram-hash",
        "print each token's Engram hash ids",
        engram_hash.add_arguments,
        engram_hash.run,
    )
    _add_command(
        sub,
        "generate",
        "complete a prompt (prefill + decode with a KV cache)",
        generate.add_arguments,
        generate.run,
    )
    _add_command(
        sub,
        "check-pp",
        "every layer partition must reproduce PP = 1 exactly",
        check_pp.add_arguments,
        check_pp.run,
    )
    _add_command(
        sub, "serve", "OpenAI-compatible server (vLLM's flag names)", serve.add_arguments, serve.run
    )
    _add_command(
        sub,
        "eval",
        "accuracy on a JSONL task file; --ab compares server arms",
        evaluate.add_arguments,
        evaluate.run,
    )
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError) as exc:
        print(f"engramrt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ProcessExitedException as exc:  # the stage printed its own one-line error
        print(f"engramrt {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code if exc.exit_code == 2 else 1
    except ProcessException as exc:  # a stage raised; its traceback is in exc
        print(f"engramrt {args.command}: error: a stage process failed:\n{exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
