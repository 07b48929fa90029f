"""The answer-quality commands: `fleet sandbox` (the cells' packages), `fleet eval`, `fleet
program` and `fleet optimize`, their arguments and which module runs each."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

COMMANDS = ("sandbox", "eval", "program", "optimize")


def add_commands(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    from fleet_cli.evals.command import add_optimize_parser
    from fleet_cli.evals.command import add_parser as add_eval_parser
    from fleet_cli.programs import add_parser as add_program_parser

    sandbox = command("sandbox", "the local sandbox's Python packages (sandbox.python.packages)")
    sandbox_commands = sandbox.add_subparsers(dest="sandbox_command", required=True)
    sandbox_commands.add_parser(
        "build", help="build the packages' read-only environment on this host (once per package set)"
    )
    add_eval_parser(command("eval", "run a dataset as Turns and score the answers; compare two receipts"))
    add_program_parser(command("program", "the RLM's program versions: list, add, activate, roll back"))
    add_optimize_parser(
        command("optimize", "dspy.GEPA over the RLM's instructions on real Turns; stores candidates only")
    )


def run_command(args: argparse.Namespace, db_only_env: Mapping[str, str]) -> int:
    """`db_only_env`: the environment of a command that needs no Redis."""
    if args.command == "optimize":
        from fleet_cli.evals.command import run_optimize

        return run_optimize(args)
    if args.command == "program":
        from fleet_cli.programs import run_program_command

        return run_program_command(args, db_only_env)
    if args.command == "eval":
        from fleet_cli.evals.command import run_eval

        return run_eval(args)
    from fleet_cli.sandbox import run_sandbox

    return run_sandbox(args.sandbox_command, db_only_env)
