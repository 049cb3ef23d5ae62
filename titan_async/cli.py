"""`titan-async`: prepare data, train, resume, eval, export, report on and compare runs, and inspect configs."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from contextlib import nullcontext
from pathlib import Path

from titan_async import __version__
from titan_async.config.shipped import shipped_configs
from titan_async.core.errors import UserError

DEFAULT_CONFIG = "debug_cpu"


class _Parser(argparse.ArgumentParser):
    """Bad arguments end with one line naming the argument (exit status 2), like every bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type of counts: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def count(text: str) -> int:
    """argparse type of counts that may be zero: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="titan-async", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def config_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help=f"TOML file, or the name of a shipped config (default: {DEFAULT_CONFIG})")
        p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config key")

    def launch_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nproc-per-node", type=positive_int, help="local worker processes (torch elastic launcher)")
        p.add_argument("--verbose", action="store_true", help="show torchtitan's log on the console")
        p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="restart the workers up to N times after one fails, from the latest intact checkpoint (default: 0)")
        p.add_argument("--skip-memory-check", action="store_true",
                       help="start even where plan's per-rank memory estimate exceeds the memory each rank has")

    train = commands.add_parser("train", help="start a training run")
    config_args(train)
    launch_args(train)
    train.add_argument("--run-dir", type=Path, help="where the run lives (default: a new directory under runs/)")
    train.add_argument("--overwrite", action="store_true", help="discard checkpoints already in --run-dir")

    resume = commands.add_parser("resume", help="continue a run from its latest complete checkpoint")
    resume.add_argument("--run-dir", type=Path, required=True)
    resume.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config key")
    launch_args(resume)

    evaluate = commands.add_parser("eval", help="validation loss and a sample from a checkpoint")
    evaluate.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint directory (RUN/checkpoint/step-N)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.add_argument("--prompt", default="def main():", help="prompt for the greedy continuation")
    evaluate.add_argument("--max-new-tokens", type=positive_int, default=32)
    evaluate.add_argument("--tasks", metavar="TASK[,TASK...]",
                          help="run lm-evaluation-harness tasks instead (names such as hellaswag,arc_easy, or task YAML "
                               "files); needs the extra: pip install 'titan-async[eval]'")
    evaluate.add_argument("--limit", type=positive_int, metavar="N", help="with --tasks: the first N examples of each task")
    evaluate.add_argument("--num-fewshot", type=count, metavar="K", help="with --tasks: K examples in each prompt (default: the task's)")
    evaluate.add_argument("--batch-size", type=positive_int, default=1, help="with --tasks: sequences per forward (default: 1)")
    evaluate.add_argument("--device", metavar="DEVICE",
                          help="with --tasks: cpu or cuda:N, where the model runs (default: the GPU when there is one, else cpu)")

    export = commands.add_parser("export", help="write a checkpoint as a Hugging Face Llama directory")
    export.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint directory (RUN/checkpoint/step-N)")
    export.add_argument("--out", type=Path, required=True, help="the directory to write")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weight dtype (default: float32)")
    export.add_argument("--overwrite", action="store_true", help="replace --out if it is not empty")

    report = commands.add_parser("report", help="an HTML page with a run's curves, config and optimizer groups")
    report.add_argument("--run-dir", type=Path, required=True)
    report.add_argument("--out", type=Path, help="HTML file to write, PNGs beside it (default: RUN/report/report.html)")

    compare = commands.add_parser("compare", help="runs' losses by step, tokens and wall-clock, and their time to a target loss")
    compare.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    compare.add_argument("--baseline", type=Path, help="the run to compare against (default: the first RUN_DIR)")
    compare.add_argument("--target", help="validation loss to reach (default: the baseline's final validation loss)")
    compare.add_argument("--out", type=Path, help="HTML file to write, PNGs beside it (default: BASELINE/compare/compare.html)")
    compare.add_argument("--json", action="store_true", help="print the results as one JSON object, and write no page")

    plan = commands.add_parser("plan", help="per-GPU memory, bubbles and a fake-process-group dry run of a config's layout")
    config_args(plan)
    plan.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    plan.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (default: 1)")
    plan.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB or 141GB (default: 80GiB)")
    plan.add_argument("--strict", action="store_true", help="exit with status 1 if some GPU would run out of memory")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--simulate", action="store_true", help="simulate every schedule on the cluster: tokens/s, bubble, ratios")
    plan.add_argument("--mfu", type=float, default=0.4, help="--simulate: model FLOPs utilisation of compute (default: 0.4)")
    plan.add_argument("--peak-tflops", type=float, default=989.0, help="--simulate: peak TFLOP/s per GPU (default: 989, H100 bf16)")
    plan.add_argument("--intra-node-gbps", type=float, default=450.0, help="--simulate: GB/s within a node (default: 450)")
    plan.add_argument("--inter-node-gbps", type=float, default=50.0, help="--simulate: GB/s between nodes (default: 50)")
    plan.add_argument("--costs-from", type=Path, metavar="RUN_DIR",
                      help="--simulate: costs measured by this traced run (metrics.pipeline_trace) of the same pipeline degree")
    plan.add_argument("--gantt", type=Path, metavar="PNG", help="--simulate: draw each schedule's first simulated steps")
    plan.add_argument("--gpu-counts", type=_gpu_counts, metavar="N,N,...",
                      help="--simulate: layouts (the config's, fewer stages, no pipeline) and schedules at each GPU count for the config's "
                           "global batch (on --nodes x --gpus-per-node), ranked by predicted time to the synchronous run's final loss")
    plan.add_argument("--advice-png", type=Path, metavar="PNG",
                      help="--gpu-counts: draw each kind of layout's hours to target against GPUs")
    plan.add_argument("--staleness", action="store_true",
                      help="the one-step delay's predicted cost for the config: token efficiency and loss gap per corrector")
    plan.add_argument("--balance", action="store_true",
                      help="--simulate: the stage split that evens out the ranks' simulated work, and every schedule's gain with it")

    prepare = commands.add_parser("prepare", help='tokenize text files into token shards for data.source = "tokens"')
    prepare.add_argument("inputs", nargs="+", metavar="INPUT", help="a jsonl/json/parquet/txt file, a directory or a glob")
    prepare.add_argument("--out", type=Path, required=True, help="directory for the shards and manifest.json")
    prepare.add_argument("--text-field", default="text", help="field that holds each document's text (default: text)")
    prepare.add_argument("--tokenizer", type=Path,
                         help="directory with tokenizer.json (default: the built-in byte-level BPE, as data.tokenizer = '')")
    prepare.add_argument("--vocab-size", type=positive_int, default=2048,
                         help="vocabulary size of the built-in tokenizer, as data.vocab_size (default: 2048)")
    prepare.add_argument("--workers", type=positive_int, help="tokenizing processes (default: one per core)")
    prepare.add_argument("--verify", action="store_true", help="check the sha256 of shards kept from an earlier run, not just their sizes")

    config = commands.add_parser("config", help="inspect configs")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the resolved config, after every check train makes before launch")
    config_args(show)
    show.add_argument("--nproc-per-node", type=positive_int,
                      help="processes the run will have (default: the product of its parallel degrees)")
    return parser


def _config_path(name: str | None) -> Path:
    """A TOML path, or a shipped config named with or without `.toml` (or as train_configs/NAME)."""
    path = Path(name or DEFAULT_CONFIG)
    if path.is_dir():
        raise UserError(f"--config {path}: is a directory; give a TOML file or the name of a shipped config")
    if path.is_file() or str(path.parent) not in (".", "train_configs") or path.suffix not in ("", ".toml"):
        return path  # a file, or a path that reading reports missing
    shipped = shipped_configs() / f"{path.stem}.toml"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in shipped_configs().glob("*.toml")))
    raise UserError(f"--config {path}: no such file, and no shipped config of that name (shipped: {names})")


def _train(args) -> int:
    from titan_async.config.run_config import load_run_config, render_toml
    from titan_async.run import process
    from titan_async.run.node_checks import once_per_node
    from titan_async.rundir import directory as runs
    from titan_async.rundir.overwrite import claim

    _check_max_restarts(args.max_restarts)
    path = _config_path(args.config)
    run = load_run_config(path, args.set)
    nproc = args.nproc_per_node or process.local_workers()
    directory = args.run_dir or runs.new_run_dir(path.stem, process.job_id())
    once_per_node("the launch checks", lambda: _check_new_run(run, directory, nproc, args.skip_memory_check))
    os.environ[process.MEMORY_CHECKED_ENV] = "1"  # the node's workers are checked: a worker does not check again
    if process.restart_count():  # torchrun restarted this worker: the run continues from its checkpoint
        return _launch(directory, nproc, args.verbose, run, args.max_restarts)
    with _coordinator_lock(directory):
        if process.is_coordinator():
            overwritten = claim(directory, args.overwrite)
            runs.save_launch(directory, render_toml(run), nproc)
            print(f"run directory: {directory}", flush=True)
            _warn_of_settings(run)
            if overwritten:
                print(f"the run it held is kept in {overwritten} until this run writes an intact checkpoint", flush=True)
        return _launch(directory, nproc, args.verbose, run, args.max_restarts)


def _resume(args) -> int:
    from titan_async.config.assemble import refuse_switches
    from titan_async.config.run_config import load_run_config, render_toml
    from titan_async.run import process
    from titan_async.run.node_checks import once_per_node
    from titan_async.rundir import directory as runs
    from titan_async.rundir import resumes

    _check_max_restarts(args.max_restarts)
    settings = runs.load_launch(args.run_dir)
    nproc = args.nproc_per_node or settings["nproc_per_node"]
    saved = load_run_config(args.run_dir / runs.CONFIG_FILE, [])
    refuse_switches(saved, args.set)
    run = load_run_config(args.run_dir / runs.CONFIG_FILE, args.set)
    with _coordinator_lock(args.run_dir):
        found: list[tuple[tuple[int, Path], str]] = []
        once_per_node("the resume checks", lambda: found.append(_check_resume(args, saved, run, nproc)))
        os.environ[process.MEMORY_CHECKED_ENV] = "1"  # the node's workers are checked: a worker does not check again
        if process.is_coordinator():
            (_, checkpoint), plan = found[0]
            resumes.stage(args.run_dir, render_toml(run), nproc, args.set)
            runs.clear_stop(args.run_dir)
            print(f"resuming {args.run_dir} from {checkpoint.name}: {plan}", flush=True)
            _warn_of_settings(run)
        return _launch(args.run_dir, nproc, args.verbose, run, args.max_restarts)


def _check_resume(args, saved, run, nproc: int) -> tuple[tuple[int, Path], str]:
    """Every check of `resume` before launch, made once per node under torchrun or Slurm: the
    checkpoint it resumes from (the latest intact one, by the cheap checks), the new values
    against what the checkpoints hold, the config at the job's world size, and plan's memory
    estimate; returns ((step, checkpoint), what the resume will do)."""
    from titan_async.run.memory_check import check_launch
    from titan_async.config.assemble import check_resumable, trainer_config
    from titan_async.run import process
    from titan_async.rundir import directory as runs
    from titan_async.rundir.checkpoints import resume_point

    point = resume_point(args.run_dir, warn=_warning if process.is_coordinator() else lambda message: None)
    if point is None:
        aside = args.run_dir / runs.OVERWRITTEN_DIR
        kept = f"; the run it replaced is in {aside}: move its files back to resume that one" if aside.is_dir() else ""
        raise UserError(f"--run-dir {args.run_dir}: no complete checkpoint to resume from (checkpoint/step-N/.metadata){kept}")
    check_resumable(saved, run)
    plan = _check_steps_left(run, point[0], args.set)
    run.check(process.world_size(nproc))
    _check_eval_device(run, nproc)
    trainer_config(run, args.run_dir, process.world_size(nproc))
    check_launch(run, nproc, args.skip_memory_check)
    return point, plan


def _check_steps_left(run, checkpoint_step: int, assignments: list[str]) -> str:
    """UserError when `--set training.steps` leaves the resumed run no step to train (at or below
    the step of the checkpoint it resumes from: torchtitan would assert, or train nothing and
    exit 0); what the resume will do, in words, otherwise. A plain resume of a complete run still
    launches: its workers verify the last checkpoint, and retrain from an earlier one if it is damaged."""
    steps = run.training.steps
    given = [a for a in assignments if a.partition("=")[0].strip() == "training.steps"]
    if given and steps <= checkpoint_step:
        raise UserError(f"--set {given[-1]!r}: the run resumes from its checkpoint at step {checkpoint_step}; "
                        f"expected training.steps > {checkpoint_step}")
    if steps <= checkpoint_step:
        return f"the run is complete (training.steps = {steps}); to train on, resume with --set training.steps=N"
    return f"training to step {steps}"


def _check_new_run(run, directory: Path, nproc: int, skip_memory_check: bool) -> None:
    """Every check of `train` before the run directory is touched: the config at the job's world
    size, the evaluation device, and (not after a restart by torchrun: the run started once) the
    trainer config and plan's memory estimate against what each rank has. Under torchrun or Slurm
    local rank 0 of each node makes them for the node (`run.node_checks`)."""
    from titan_async.run import process

    run.check(process.world_size(nproc))
    _check_eval_device(run, nproc)
    if process.restart_count():
        return
    from titan_async.run.memory_check import check_launch
    from titan_async.config.assemble import trainer_config  # after the config checks: it imports the data and trainer stack

    trainer_config(run, directory, process.world_size(nproc))
    check_launch(run, nproc, skip_memory_check)


def _check_eval_device(run, nproc: int) -> None:
    """UserError (one line) when the run benchmarks on a GPU that does not exist on this node or
    that one of its `nproc` training ranks uses."""
    from titan_async.train import eval_device

    if run.eval.tasks:
        try:
            eval_device.eval_device(run.eval.device, nproc, eval_device.visible_gpus())
        except UserError as err:
            raise UserError(f"{run.source}: {err}") from None


def _coordinator_lock(directory: Path):
    """The run directory's lock (titan_async.rundir.lock) in the process that writes the run
    directory; none in other ranks, nor in workers torchrun restarted (the first attempt took it)."""
    from titan_async.run import process
    from titan_async.rundir.lock import run_dir_lock

    if process.is_coordinator() and not process.restart_count():
        return run_dir_lock(directory)
    return nullcontext()


def _warn_of_settings(run) -> None:
    """Warn of settings that are valid but likely not meant."""
    from titan_async.pipeline.config import synchronous_throughout

    warning = synchronous_throughout(run.training)
    if warning:
        _warning(warning)


def _warning(message: str) -> None:
    print(f"titan-async: warning: {message}", file=sys.stderr, flush=True)


def _check_max_restarts(count: int) -> None:
    from titan_async.run import process

    if count < 0:
        raise UserError(f"--max-restarts {count}: expected a count >= 0")
    if count and process.launched_externally():
        raise UserError(f"--max-restarts {count}: under torchrun or Slurm, pass it to torchrun, which restarts the workers")


def _launch(directory: Path, nproc: int, verbose: bool, run, max_restarts: int) -> int:
    from titan_async.run import launch, process
    from titan_async.rundir import directory as runs
    from titan_async.rundir.overwrite import release_overwritten
    from titan_async.rundir.record import diverged_validation

    status = launch.run(directory, nproc, verbose, run, max_restarts)
    if not process.is_coordinator():
        return status
    _draw_pipeline_trace(directory)
    traces = directory / "comm_traces"  # NCCL's flight recorder dumps here on a hang; gloo never does
    if traces.is_dir() and not any(traces.iterdir()):
        traces.rmdir()
    if not release_overwritten(directory) and (directory / runs.OVERWRITTEN_DIR).is_dir():
        _warning(f"this run has no intact checkpoint, so the run it replaced is kept in {directory / runs.OVERWRITTEN_DIR}")
    stop = runs.early_stop(directory)
    if stop is None:
        diverged = diverged_validation(directory) if status == 0 else None
        if diverged:
            _warning(f"the validation loss at step {diverged[0]} is {diverged[1]}: the model diverged (see {directory}/metrics.jsonl)")
            return 3
        return status
    cause = "signal" if stop["reason"] == "signal" else f"too many steps with non-finite gradients (see {directory}/logs)"
    print(f"stopped at step {stop['step']} by {cause}, with a checkpoint; continue with: titan-async resume --run-dir {directory}")
    return 130 if stop["reason"] == "signal" else 3


def _draw_pipeline_trace(directory: Path) -> None:
    """Merge the ranks' pipeline traces of a traced run into trace.json and timeline.png."""
    from titan_async.pipeline.trace import draw_gantt, merge_traces

    folder = directory / "pipeline"
    parts = sorted(folder.glob("trace_rank*.json")) if folder.is_dir() else []
    if parts:
        events = merge_traces(parts, folder / "trace.json")
        draw_gantt(events, folder / "timeline.png", f"pipeline timeline: {directory.name}")


def _eval(args) -> int:
    from titan_async.commands.evaluate import benchmark_checkpoint, evaluate_checkpoint
    from titan_async.train.eval_device import DEVICE_PATTERN

    if args.tasks is None:
        for name, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot), ("--device", args.device)):
            if value is not None:
                raise UserError(f"{name}: applies only with --tasks")
    if args.device is not None and not re.fullmatch(DEVICE_PATTERN, args.device):
        raise UserError(f"--device {args.device}: expected cpu or cuda:N")
    if args.tasks is not None:
        return benchmark_checkpoint(args.checkpoint, args.tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                                    batch_size=args.batch_size, device=args.device, as_json=args.json)
    return evaluate_checkpoint(args.checkpoint, as_json=args.json, prompt=args.prompt, max_new_tokens=args.max_new_tokens)


def _export(args) -> int:
    from titan_async.commands.export import export_checkpoint

    export_checkpoint(args.checkpoint, args.out, args.dtype, args.overwrite)
    print(f"exported {args.checkpoint} to {args.out}")
    return 0


def _report(args) -> int:
    from titan_async.commands.report import write_report

    print(f"report: {write_report(args.run_dir, args.out)}")
    return 0


def _compare(args) -> int:
    from titan_async.commands.compare import run_compare

    return run_compare(args.run_dirs, args.baseline, args.target, args.out, args.json)


def _gpu_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive GPU counts separated by commas, got {text!r}")
    return counts


def _check_plan_arguments(args) -> None:
    """plan's arguments that need no config: the flags that apply only with others, and the
    cluster (parsed into `args.cluster`)."""
    from titan_async.cluster.cluster import Cluster

    args.cluster = Cluster.parse(args.nodes, args.gpus_per_node, args.gpu_memory)
    for flag, value in (("--costs-from", args.costs_from), ("--gantt", args.gantt), ("--balance", args.balance or None),
                        ("--gpu-counts", args.gpu_counts)):
        if value is not None and not args.simulate:
            raise UserError(f"{flag}: applies only with --simulate")
    if args.advice_png is not None and args.gpu_counts is None:
        raise UserError("--advice-png: applies only with --gpu-counts")
    if args.staleness and args.gpu_counts is not None:
        raise UserError("--staleness: applies only without --gpu-counts (the advisor already weighs each schedule by the delay's cost)")


def _check_train_arguments(args) -> None:
    """--run-dir must be able to become a directory (no file in its place or above it)."""
    from titan_async.rundir.directory import check_creatable

    if args.run_dir is not None:
        check_creatable(args.run_dir)


ARGUMENT_CHECKS = {"plan": _check_plan_arguments, "train": _check_train_arguments}
"""Per command, the checks of its arguments alone: they run before torch is imported."""


def _plan(args) -> int:
    from titan_async.commands.plan.command import run_plan
    from titan_async.config.run_config import load_run_config
    from titan_async.data.batch_ramp import after_ramp

    simulation = None
    if args.simulate:
        from titan_async.cluster.simulate import SimulationOptions

        simulation = SimulationOptions(args.mfu, args.peak_tflops, args.intra_node_gbps, args.inter_node_gbps,
                                       args.costs_from, args.gantt)
    run = load_run_config(_config_path(args.config), args.set)
    run.training = after_ramp(run.training)  # planned at the batch the run keeps after its ramp
    if args.gpu_counts is not None:
        from titan_async.commands.plan.command import run_advice

        return run_advice(run, args.cluster, simulation, args.gpu_counts, args.json, args.advice_png)
    return run_plan(run, args.cluster, args.strict, args.json, simulation, args.balance, args.staleness)


def _prepare(args) -> int:
    from titan_async.data.prepare import prepare_tokens
    from titan_async.data.section import DataSection
    from titan_async.data.sources import tokenizer_dir

    if args.tokenizer and not (args.tokenizer / "tokenizer.json").is_file():
        raise UserError(f"--tokenizer {args.tokenizer}: expected a directory containing tokenizer.json")
    data = DataSection(tokenizer=str(args.tokenizer or ""), vocab_size=args.vocab_size)
    result = prepare_tokens(args.inputs, args.out, tokenizer_dir(data), args.text_field, args.workers, args.verify,
                            progress=sys.stderr.isatty())
    shards = result.manifest["shards"]
    tokens = sum(s["token_count"] for s in shards)
    rate = result.tokens_written / result.seconds if result.seconds else 0.0
    print(f"{args.out}: {tokens:,} tokens in {sum(s['document_count'] for s in shards):,} documents, {len(shards)} shard(s) "
          f"({result.shards_kept} kept from an earlier run), {result.manifest['dtype']}")
    if result.tokens_written:
        print(f"tokenized {result.tokens_written:,} tokens in {result.seconds:.1f} s: {rate:,.0f} tokens/s, "
                  f"{rate / result.workers:,.0f} tokens/s per core ({result.workers} worker(s))")
    return 0


def _config_show(args) -> int:
    from rich.console import Console
    from rich.syntax import Syntax

    from titan_async.config.run_config import load_run_config, render_toml
    from titan_async.run import process

    run = load_run_config(_config_path(args.config), args.set)
    run.check(process.world_size(args.nproc_per_node or run.implied_world_size()))
    _warn_of_settings(run)
    text = render_toml(run)
    Console().print(Syntax(text, "toml", theme="ansi_dark")) if sys.stdout.isatty() else print(text, end="")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.ERROR)
    handlers = {"train": _train, "resume": _resume, "eval": _eval, "export": _export, "config": _config_show,
                "report": _report, "compare": _compare, "plan": _plan, "prepare": _prepare}
    try:
        ARGUMENT_CHECKS.get(args.command, lambda args: None)(args)
        # torch comes in here, once the arguments are known to be good: --help, --version and their errors stay fast.
        from titan_async.core import platform
        from titan_async.run.worker import quiet_library_noise

        quiet_library_noise()
        platform.configure()
        sys.exit(handlers[args.command](args))
    except UserError as err:
        print(f"titan-async: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("titan-async: aborted: the steps since the last checkpoint are lost", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
