"""`fleet eval run|compare|generate`: the command's arguments and what each does."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from fleet_cli.evals.dataset import BUILT_IN_METRICS, Dataset, DatasetError, Metric, load_dataset, metric_of
from fleet_cli.evals.generate import KINDS, write_dataset

if TYPE_CHECKING:
    from collections.abc import Callable

    from fleet_cli.evals.metrics import Judge
    from fleet_cli.evals.runner import Progress, Target

TOKEN_ENV = "FLEET_API_TOKEN"


def add_parser(command: argparse.ArgumentParser) -> None:
    actions = command.add_subparsers(dest="eval_command", required=True)
    run = actions.add_parser("run", help="run a JSONL dataset as Turns and write a receipt")
    run.add_argument(
        "dataset", type=Path, help="JSONL: {id, request, attachments?, expected?, metric?} per line"
    )
    run.add_argument(
        "--api-url", help=f"a running gateway (its token from {TOKEN_ENV}); default: an embedded stack"
    )
    run.add_argument(
        "--profile", help="the embedded stack's profile (or the name a deployment's receipt records)"
    )
    run.add_argument("--concurrency", type=positive, default=4, help="Turns at once (default: %(default)s)")
    run.add_argument(
        "--metric",
        default="exact",
        help=f"for rows naming none: {', '.join(BUILT_IN_METRICS)} or module:function (default: %(default)s)",
    )
    run.add_argument("--tolerance", type=float, default=0.0, help="numeric: the difference allowed")
    run.add_argument("--judge-profile", help="the profile whose root LM grades `judge` rows")
    run.add_argument("--limit", type=positive, help="only the first N rows")
    run.add_argument("--program-version", help="run this program version, not the active one (admin token)")
    run.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one Turn may take (default: %(default)s)"
    )
    run.add_argument("--out", type=Path, help="the receipt (default: eval-<dataset>-<UTC time>.json)")
    compare = actions.add_parser("compare", help="B against A, row by row, with a paired significance test")
    compare.add_argument("a", type=Path)
    compare.add_argument("b", type=Path)
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    export = actions.add_parser(
        "export-feedback", help="users' ratings of answers as a dataset (reads the DB)"
    )
    export.add_argument("--out", type=Path, required=True)
    export.add_argument("--rating", choices=("up", "down", "all"), default="all")
    whose = export.add_mutually_exclusive_group(required=True)
    whose.add_argument("--tenant", help="only this tenant's sessions")
    whose.add_argument(
        "--all-tenants", action="store_true", help="every tenant's (their words mix in one file)"
    )
    generate = actions.add_parser("generate", help="write a seeded synthetic dataset (niah, oolong)")
    generate.add_argument("kind", choices=KINDS)
    generate.add_argument("--rows", type=positive, default=10)
    generate.add_argument("--seed", type=int, default=7)
    generate.add_argument("--min-chars", type=positive, default=100_000)
    generate.add_argument("--max-chars", type=positive, default=1_000_000)
    generate.add_argument("--out", type=Path, required=True)


def run_eval(args: argparse.Namespace) -> int:
    if args.eval_command == "generate":
        path = write_dataset(
            args.out, args.kind, args.rows, args.seed, smallest=args.min_chars, largest=args.max_chars
        )
        print(f"wrote {args.rows} rows to {path}")
        return 0
    if args.eval_command == "compare":
        return run_compare(args.a, args.b, as_json=args.json)
    if args.eval_command == "export-feedback":
        from fleet_cli.evals.feedback import export_feedback

        return export_feedback(
            {"FLEET_REDIS_URL": "redis://unused", **os.environ}, args.out, args.rating, args.tenant
        )
    return run_dataset_command(args)


def run_compare(a: Path, b: Path, *, as_json: bool) -> int:
    from fleet_cli.evals.compare import ReceiptError, compare, load_receipt, render

    try:
        result = compare(load_receipt(a), load_receipt(b))
    except ReceiptError as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if as_json else render(result, str(a), str(b)))
    return 0


def run_dataset_command(args: argparse.Namespace) -> int:
    from fleet_cli.evals.runner import Progress, Target

    try:
        dataset = load_dataset(args.dataset, args.limit)
        default = msgspec.convert({"name": args.metric, "tolerance": args.tolerance}, Metric)
    except msgspec.ValidationError as exc:
        names = f"{', '.join(BUILT_IN_METRICS)} or module:function"
        print(f"fleet: --metric/--tolerance: {exc} ({names})", file=sys.stderr)
        return 2
    except DatasetError as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 2
    judge = judge_of(args.judge_profile)
    problem = metric_problem(dataset, default, judge)
    if problem is not None:
        print(f"fleet: {problem}", file=sys.stderr)
        return 2
    out = args.out or Path(f"eval-{dataset.path.stem}-{datetime.now(UTC):%Y%m%dT%H%M%S}.json")
    evaluation = Evaluation(args, dataset, default, judge, out=out, progress=Progress(len(dataset.rows)))
    if args.api_url:
        code = evaluation(Target(args.api_url, os.environ.get(TOKEN_ENV), args.profile, args.api_url))
    else:
        code = on_embedded_stack(args.profile, evaluation)
    if evaluation.interrupted:  # rows still in flight would keep this process: the receipt is out
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def judge_of(profile: str | None) -> Judge | None:
    """The `--judge-profile`'s root LM as a judge, or None without one."""
    if not profile:
        return None
    from fleet_cli.evals.metrics import litellm_judge

    return litellm_judge(profile)


def metric_problem(dataset: Dataset, default: Metric, judge: Judge | None) -> str | None:
    """Why some row cannot be scored (a judge without --judge-profile, a hook that does not
    import, a pattern that does not compile), before any Turn is paid for."""
    from fleet_cli.evals.metrics import check_metric

    for row in dataset.rows:
        problem = check_metric(metric_of(row, default), dataset.path.parent, judge)
        if problem is not None:
            return f"row {row.id!r}: {problem}"
    return None


class Evaluation:
    """Run the dataset on a target, write the receipt, say what it holds; the exit code."""

    def __init__(
        self, args: argparse.Namespace, dataset: Dataset, default: Metric, judge: Judge | None, *,
        out: Path, progress: Progress,
    ) -> None:  # fmt: skip
        self.args, self.dataset, self.default, self.judge = args, dataset, default, judge
        self.out, self.progress = out, progress
        self.interrupted = False

    def __call__(self, target: Target) -> int:
        from fleet_cli.evals.gateway import TurnRefused
        from fleet_cli.evals.runner import run_dataset, write_receipt

        try:
            receipt = run_dataset(
                self.dataset, target, concurrency=self.args.concurrency, default_metric=self.default,
                judge=self.judge, turn_timeout=self.args.timeout, on_row=self.progress.row_done,
                program_version=self.args.program_version,
            )  # fmt: skip
        except TurnRefused as exc:
            print(f"fleet: the gateway refused the evaluation: {exc}", file=sys.stderr)
            return 2
        write_receipt(receipt, self.out)
        totals = receipt["totals"]
        print(
            f"{totals['rows']} rows, {totals['failed']} not completed, accuracy {totals['accuracy']}, "
            f"p50 {totals['seconds_p50']} s, p95 {totals['seconds_p95']} s, "
            f"$ per query {totals['usd_per_query']}"
        )
        print(f"receipt: {self.out}")
        if receipt["interrupted"]:
            self.interrupted = True
            print("fleet: interrupted: the receipt holds the rows that ended", file=sys.stderr)
            return 130
        return 0 if totals["completed"] else 1


def on_embedded_stack(profile: str | None, evaluate: Callable[[Target], int]) -> int:
    """Start the embedded stack in the background (logs in .fleet/logs/), evaluate, stop it;
    Ctrl-C stops the evaluation (and then the stack)."""
    from fleet_cli.embedded import prepare_embedded, start_stack
    from fleet_cli.evals.runner import Target
    from fleet_cli.sides import refuse_without

    refusal = refuse_without("eval run", "gateway", "worker", "embedded")
    if refusal is not None:
        return refusal
    port = free_port()
    prepared = prepare_embedded(profile, "127.0.0.1", port)
    if isinstance(prepared, int):
        return prepared
    logs = prepared.data_dir / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    try:
        print(f"fleet: starting the embedded stack (logs in {logs})...", file=sys.stderr, flush=True)
        url = start_stack(prepared, host="127.0.0.1", port=port, workers=1, logs=logs)
        if isinstance(url, int):
            return url
        return evaluate(Target(url, None, prepared.settings.profile_name, "embedded"))
    finally:
        prepared.stack.stopping = True
        prepared.stack.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def add_optimize_parser(command: argparse.ArgumentParser) -> None:
    command.add_argument("--dataset", type=Path, required=True, help="JSONL, as for `fleet eval run`")
    command.add_argument("--budget", type=positive, required=True, help="GEPA's metric calls: Turns at most")
    command.add_argument(
        "--reflection-profile", required=True, help="the profile whose root LM proposes new instructions"
    )
    command.add_argument(
        "--api-url", help=f"a running gateway (an admin token in {TOKEN_ENV}); default: embedded"
    )
    command.add_argument("--profile", help="the embedded stack's profile")
    command.add_argument("--metric", default="exact", help="for rows naming none (default: %(default)s)")
    command.add_argument("--judge-profile", help="the profile whose root LM grades `judge` rows")
    command.add_argument("--val-fraction", type=float, default=0.5, help="rows kept for validation (0.5)")
    command.add_argument("--seed", type=int, default=0)
    command.add_argument("--concurrency", type=positive, default=2)
    command.add_argument("--timeout", type=float, default=900.0, help="seconds one Turn may take")
    command.add_argument("--out", type=Path, help="the report (default: optimize-<dataset>-<UTC time>.json)")


def run_optimize(args: argparse.Namespace) -> int:
    from fleet_cli.evals.gateway import Gateway, TurnRefused
    from fleet_cli.evals.optimize import OptimizeError, optimize, reflection_lm_of
    from fleet_cli.evals.runner import Target, write_receipt

    try:
        dataset = load_dataset(args.dataset)
        default = msgspec.convert({"name": args.metric}, Metric)
        if len(dataset.rows) < 2 or not 0 < args.val_fraction < 1:
            raise DatasetError("optimizing needs two rows or more, and --val-fraction between 0 and 1")
        reflection = reflection_lm_of(args.reflection_profile)
    except (DatasetError, msgspec.ValidationError, ValueError) as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 2
    judge = judge_of(args.judge_profile)
    problem = metric_problem(dataset, default, judge)
    if problem is not None:
        print(f"fleet: {problem}", file=sys.stderr)
        return 2
    out = args.out or Path(f"optimize-{dataset.path.stem}-{datetime.now(UTC):%Y%m%dT%H%M%S}.json")

    def run(target: Target) -> int:
        gateway = Gateway(target.url, target.token, args.timeout, connections=args.concurrency + 4)
        report: dict[str, Any] = {
            "kind": "fleet-optimize/1",
            "dataset": str(dataset.path),
            "completed": False,
        }
        try:
            gateway.check_access()
            optimize(
                dataset, gateway, report, default_metric=default, reflection_lm=reflection,
                budget=args.budget, val_fraction=args.val_fraction, seed=args.seed,
                concurrency=args.concurrency, judge=judge,
            )  # fmt: skip
            report["completed"] = True
        except TurnRefused as exc:
            print(f"fleet: the gateway refused the optimizer (it needs `admin`): {exc}", file=sys.stderr)
            return 2
        except OptimizeError as exc:
            print(f"fleet: {exc}", file=sys.stderr)
            return 2
        finally:
            gateway.close()
            if "active" in report:  # it started: what it stored is in the report, whatever happened
                write_receipt(report, out)
        active = report["active"]
        print(f"active {active['id']}: validation score {active['validation_score']}")
        for candidate in report["candidates"]:
            print(f"candidate {candidate['id']}: validation score {candidate['score']}")
        print(f"nothing was activated; `fleet program activate <id>` makes a candidate active. report: {out}")
        return 0

    if args.api_url:
        return run(Target(args.api_url, os.environ.get(TOKEN_ENV), args.profile, args.api_url))
    return on_embedded_stack(args.profile, run)
