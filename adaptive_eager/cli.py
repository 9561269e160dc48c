"""``adaptive-eager`` / ``python -m adaptive_eager``: run a script under the runtime."""
from __future__ import annotations

import argparse
import os
import runpy
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaptive-eager",
                                     description="Adaptive eager execution for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a Python script under the runtime")
    run.add_argument("--no-compile", action="store_true",
                     help="record and key segments but compile nothing (debugging)")
    run.add_argument("script", help="path of the script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    commands.add_parser("config", help="list every setting with its value and help")
    return parser


def _run_script(options: argparse.Namespace) -> int:
    if options.no_compile:
        os.environ["NEURON_ADAPTIVE_EAGER_COMPILE"] = "0"
    if not os.path.isfile(options.script):
        print(f"adaptive-eager: no such script: {options.script}", file=sys.stderr)
        return 2
    from adaptive_eager import api
    sys.argv = [options.script, *options.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(options.script)))
    api.enable()
    try:
        runpy.run_path(options.script, run_name="__main__")
    finally:
        api.disable()
    return 0


def _show_config() -> int:
    from adaptive_eager.config import config
    for row in config.describe():
        print(f"{row['env']}={row['value']!r}\n    {row['help']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from adaptive_eager.config import ConfigError
    options = _parser().parse_args(argv)
    try:
        if options.command == "run":
            return _run_script(options)
        return _show_config()
    except ConfigError as err:
        print(f"adaptive-eager: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
