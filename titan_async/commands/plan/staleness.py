"""`plan --staleness`: the delay's predicted cost for a config (`cluster.staleness`): per corrector,
the token efficiency with its range, the tokens a delayed run needs to reach the synchronous
run's final loss, and the loss gap at equal tokens, with what the prediction extrapolates."""

from __future__ import annotations

from typing import Any

from titan_async.cluster import staleness
from titan_async.config.run_config import RunConfig
from titan_async.pipeline.schedules import STREAMING_SCHEDULES


def staleness_report(run: RunConfig, parameters: int, tokens_per_step: int, delay: int = 1, stages: int = 1, window: int = 1,
                     law: staleness.Law | None = None) -> dict[str, Any]:
    """The predicted delay-1 cost of `run` (`parameters` total, `tokens_per_step` global) for each
    corrector, JSON-ready, and at the config's own delay of `delay` > 1 steps ("at_delay") where
    the law has a delay term for it; the notes say where the config's delay (`delay` steps,
    PACI's local steps on `stages` stages with `window` microbatches per step) is not delay 1."""
    optimizer = run.optimizer.name
    law = law or staleness.law()
    steps, tokens = run.training.steps, run.training.steps * tokens_per_step
    correctors, extrapolated = {}, ()
    for corrector in staleness.CORRECTORS:
        found = staleness.estimate(optimizer, corrector, steps, parameters, law)
        extrapolated = found.extrapolated
        correctors[corrector] = {
            "token_efficiency": found.efficiency,
            "token_efficiency_range": [found.low, found.high],
            "tokens_factor": found.tokens_factor,
            "tokens_factor_range": [1 / found.high, 1 / found.low],
            "gap": staleness.gap(found.efficiency, tokens),
            "gap_range": [staleness.gap(found.high, tokens), staleness.gap(found.low, tokens)],
        }
        if delay > 1 and f"{optimizer}+{corrector}" in law.delay_exponents:
            longer = staleness.estimate(optimizer, corrector, steps, parameters, law, delay)
            correctors[corrector]["at_delay"] = {"delay": delay, "token_efficiency": longer.efficiency,
                                                 "token_efficiency_range": [longer.low, longer.high],
                                                 "tokens_factor": longer.tokens_factor, "extrapolated": list(longer.extrapolated)}
    extrapolated += tuple(dict.fromkeys(note for found in correctors.values() for note in found.get("at_delay", {}).get("extrapolated", ())
                                        if note not in extrapolated))
    schedule = run.parallelism.pipeline_parallel_schedule
    delayed = schedule in STREAMING_SCHEDULES or run.training.gradient_delay > 0
    notes = [
        f"gap: on Chinchilla's loss curve at {tokens:,.0f} tokens (slope -dL/d ln D = {staleness.chinchilla_slope(tokens):.4f}); "
        "the studies' own loss scale does not transfer",
        f"the law takes steps and parameters; it assumes an lr tuned for the run (the studies swept theirs), "
        f"so optimizer.lr = {run.optimizer.lr:g} is not an input",
    ]
    if schedule.lower() == "paci":
        notes.append(_paci_note(run, stages, window))
    if delay > 1:
        known = any("at_delay" in found for found in correctors.values())
        notes.insert(0, f"this config delays each gradient by {delay} steps (fewer microbatches than stages): "
                        + ("the 'at d' lines add the law's delay term, ln(1/eta) x d ** exponent, fitted on the studies' "
                           f"delays {law.delays[0]}..{law.delays[1]}" if known else
                           "the law has no delay term for it, so these delay-1 figures understate its cost"))
    if not delayed:
        notes.insert(0, f"the config's schedule {schedule} trains without delay: the figures are those of a delayed run of it")
    return {
        "optimizer": optimizer,
        "config_corrector": staleness.corrector_of(run.optimizer.error_feedback.enabled, run.training.weight_prediction),
        "parameters": parameters,
        "steps": steps,
        "tokens_per_step": tokens_per_step,
        "tokens": tokens,
        "tokens_per_parameter": tokens / parameters,
        "correctors": correctors,
        "extrapolated": list(extrapolated),
        "law": {"source": law.source, "steps": list(law.steps), "parameters": list(law.parameters),
                "steps_exponent": law.steps_exponent_of(optimizer), "parameters_exponent": law.parameters_exponent,
                "residual_factor": law.residual_factor, "range_factors": law.range_factors},
        "notes": notes,
    }


CORRECTOR_LABELS = {"none": "delay 1", "ef": "delay 1 + error feedback", "predict": "delay 1 + weight prediction"}


def staleness_text(report: dict[str, Any]) -> str:
    """The report as lines: one per corrector (the config's marked), then the extrapolations and notes."""
    lines = [f"Delay cost ({report['optimizer']}, {report['parameters']:,} parameters, {report['steps']:,} steps x "
             f"{report['tokens_per_step']:,} tokens = {report['tokens_per_parameter']:.1f} tokens per parameter):"]
    for corrector, found in report["correctors"].items():
        low, high = found["token_efficiency_range"]
        factor_low, factor_high = found["tokens_factor_range"]
        gap_low, gap_high = found["gap_range"]
        mark = "  <- the config" if corrector == report["config_corrector"] else ""
        lines.append(f"  {CORRECTOR_LABELS[corrector]:<28} token efficiency {found['token_efficiency']:.3f} ({low:.3f}..{high:.3f}); "
                     f"{_factor(found['tokens_factor'])}x the tokens to the synchronous loss ({_factor(factor_low)}..{_factor(factor_high)}); "
                     f"gap {found['gap']:+.4f} ({gap_low:+.4f}..{_gap(gap_high)}){mark}")
        if "at_delay" in found:
            longer = found["at_delay"]
            low, high = longer["token_efficiency_range"]
            lines.append(f"  {'  at d = ' + str(longer['delay']):<28} token efficiency {longer['token_efficiency']:.3f} "
                         f"({low:.3f}..{high:.3f}); {_factor(longer['tokens_factor'])}x the tokens to the synchronous loss")
    law = report["law"]
    lines.append(f"  law: {law['source']}, fitted on steps {law['steps'][0]:,}..{law['steps'][1]:,} and parameters "
                 f"{law['parameters'][0]:,}..{law['parameters'][1]:,}")
    lines += [f"  extrapolates: {note}" for note in report["extrapolated"]]
    lines += [f"  note: {note}" for note in report["notes"]]
    return "\n".join(lines)


def _paci_note(run: RunConfig, stages: int, window: int) -> str:
    """Whether the delay-1 figures bound PACI's cost: a microbatch crosses at most one local step
    of its stage when the stage steps every a >= p - 1 backwards, up to ceil((p - 1) / a) when fewer."""
    accumulation = run.parallelism.paci.accumulation or window
    if accumulation >= stages - 1:
        return "PACI: a microbatch crosses at most one update, so the delay-1 figures bound its cost from above"
    crossed = -(-(stages - 1) // accumulation)
    return (f"PACI with {accumulation} backwards per local step on {stages} stages: a microbatch crosses up to {crossed} updates "
            "of its stage, which the delay-1 figures do not bound")


def _factor(value: float) -> str:
    """A tokens factor as text; beyond 1000 (an efficiency near 0, far out of the law's range) only that bound."""
    return f"{value:.3f}" if value <= 1000 else ">1000"


def _gap(value: float) -> str:
    return f"{value:+.4f}" if value <= 1000 else ">+1000"
