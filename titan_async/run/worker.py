"""One training process: reads the run directory's config and trains (or resumes).

Started in-process for a single local worker, forked by the launcher's elastic agent
(`launch.ForkedAgent`), or by an external torchrun
(`python -m torch.distributed.run ... -m titan_async.run.worker RUN_DIR`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path

from titan_async.core import comm_log, platform, streams
from titan_async.core.platform import DropMessages
from titan_async.rundir import checkpoints, directory as runs, resumes
from titan_async.rundir.after_save import AfterSaves
from titan_async.run.node_checks import once_per_node
from titan_async.run.process import MEMORY_CHECKED_ENV, exit_with_parent, name_worker, restart_count


def quiet_library_noise() -> None:
    """Silence deprecation chatter from libraries that says nothing about the run."""
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _setup_logging(run_dir: Path, verbose: bool) -> None:
    """Full log per rank under run_dir/logs; only warnings on the console unless verbose."""
    rank = int(os.environ.get("RANK", "0"))
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.INFO)
    formatter = logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    file_handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    file_handler.setFormatter(formatter)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if verbose else logging.WARNING)
    console.setFormatter(formatter)
    root.addHandler(file_handler)
    root.addHandler(console)
    os.environ["KINETO_LOG_LEVEL"] = "5"
    quiet_library_noise()
    root.addFilter(DropMessages("model.safetensors.index.json not found", "Pipeline Parallel loss is not visible"))


def _check_cuda_usable() -> None:
    """Log whether this worker can use CUDA after its start; on a GPU, refuse to train when it
    cannot (forked from a process that had made a CUDA call), naming the cause."""
    bad_fork = platform.forked_after_cuda()
    logging.getLogger("titan_async").info(f"worker pid {os.getpid()}: forked after a CUDA call: {'yes' if bad_fork else 'no'}")
    if bad_fork and not platform.is_cpu():
        raise RuntimeError("this worker was forked from a process that had made a CUDA call, so it cannot use CUDA; "
                           "start workers by spawn (torchrun --start-method spawn) or keep the launcher off CUDA")


def _resume_point(run_dir: Path, run):
    """`run` set to load the run's latest intact checkpoint (torchtitan would take the latest
    with a .metadata file), unless `checkpoint.load_step` names one. After an elastic restart
    rank 0 logs the damaged checkpoints it skips, the step it resumes from and the steps lost.
    Only rank 0 checks the checkpoints to choose (cheap checks: no file is read whole before the
    process group exists); the trainer hands its choice to every rank
    (`AsyncTrainer.load_rank0s_choice`), and each rank verifies the checksums of its share of the
    files it loads (`titan_async.train.verified_load`, which falls back from a damaged checkpoint
    to the previous intact one)."""
    if not run.checkpoint.enable or run.checkpoint.load_step != -1 or os.environ.get("RANK", "0") != "0":
        return run
    restart = restart_count()
    log = logging.getLogger("titan_async")
    announce = restart > 0
    point = checkpoints.resume_point(run_dir, log.warning if announce else lambda message: None)
    step = point[0] if point else 0
    if announce:
        lost = max(checkpoints.last_logged_step(run_dir) - step, 0)
        origin = f"resumed from step {step} ({point[1]})" if point else "no checkpoint yet, started from step 0"
        log.warning(f"restart {restart}: {origin}; {lost} step{'s' * (lost != 1)} lost")
    if point is None:
        return run
    return dataclasses.replace(run, checkpoint=dataclasses.replace(run.checkpoint, load_step=step))


def _config_to_train(run_dir: Path):
    """The config a resume staged (`rundir.resumes`), else the run's config.toml."""
    from titan_async.config.run_config import load_run_config, parse_run_config

    staged = resumes.staged_config(run_dir)
    if staged is not None:
        return parse_run_config(staged, str(run_dir / runs.RESUME_STAGED_FILE))
    return load_run_config(run_dir / runs.CONFIG_FILE)


def train(run_dir: Path, verbose: bool = False, run=None) -> int:
    """Train the run in `run_dir` from its latest intact checkpoint (if any); returns the exit status.

    `run` is the resolved RunConfig; None reads the run directory's config.toml.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent()
    platform.configure()
    comm_log.install_from_environment()
    streams.enable_model_from_environment()
    _setup_logging(run_dir, verbose)
    _check_cuda_usable()
    import datasets

    datasets.disable_progress_bars()
    import torch.distributed as dist

    from titan_async.run.memory_check import check_launch
    from titan_async.config.assemble import trainer_config
    from titan_async.pipeline.config import prepare_split_backward

    run = _resume_point(run_dir, run or _config_to_train(run_dir))
    if not os.environ.get(MEMORY_CHECKED_ENV):  # started by torchrun without titan-async's launcher: check here, once per node
        once_per_node("the memory check", lambda: check_launch(run, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    warning = prepare_split_backward(run.parallelism.pipeline_parallel_schedule, run.compile.enable and not platform.is_cpu())
    if warning:
        logging.getLogger("titan_async").warning(warning)
    trainer = trainer_config(run, run_dir, int(os.environ.get("WORLD_SIZE", "1"))).build()
    after_saves = AfterSaves(trainer.checkpointer, run_dir, dist.get_rank())
    trainer.save_hooks.after.append(after_saves)
    if dist.get_rank() == 0:
        runs.record_world_size(run_dir, dist.get_world_size())
        trainer.first_step_hooks.append(lambda: resumes.commit(run_dir, trainer.step - 1))
    try:
        trainer.train()
    finally:
        trainer.close()
        after_saves.finish()
    if trainer.stop_reason is not None and dist.get_rank() == 0:
        runs.record_stop(run_dir, trainer.step, trainer.stop_reason)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main() -> None:
    """`python -m titan_async.run.worker RUN_DIR [--verbose] [--skip-memory-check]` (under torchrun)."""
    if "--skip-memory-check" in sys.argv[2:]:
        os.environ[MEMORY_CHECKED_ENV] = "1"
    run_worker(sys.argv[1], "--verbose" in sys.argv[2:])


def run_worker(run_dir: str, verbose: bool) -> None:
    """A worker that torch's elastic agent started (as a fresh interpreter, or forked from the
    launcher's agent after it imported everything); exits 2 with one line on a UserError (only on
    rank 0 for an AgreedError), 1 with its traceback on stderr on any other error (the agent's
    summary names only the first rank that failed, and a forked worker's traceback would
    otherwise go to its error file only); silently with 128 + the signal where the agent stops it
    before training has taken over SIGTERM (after another worker failed, which says why)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from titan_async.core.errors import AgreedError, UserError

    name_worker()
    platform.set_cpu_threads()
    try:
        status = train(Path(run_dir), verbose)
    except UserError as err:
        if not isinstance(err, AgreedError) or os.environ.get("RANK", "0") == "0":
            print(f"titan-async: {err}", file=sys.stderr)
        sys.exit(2)
    except SignalException as stop:
        sys.exit(128 + stop.sigval)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(status)


if __name__ == "__main__":
    main()
