"""Start-up check of a pipeline configuration for variable-length micro-batches: torch refuses a
bad micro-batch count only once the schedule is built; this mirror of its rules refuses it first.
"""

from __future__ import annotations

# Schedules the varlen runner is tested with (tests/test_pipeline_varlen.py), by torch's names
# (matched case-insensitively, as torch's get_schedule_class does), with their stage style:
# "single" runs 1 stage per rank, "multi" 2 or more (looped: rank r holds r, r + pp, ...), "v"
# exactly 2 (rank r holds r and 2 pp - 1 - r, so the stage pairs in the middle pass tensors on
# the rank instead of sending them). The zero-bubble ones split each backward into an input-grad
# and a weight-grad action.
VARLEN_SCHEDULES: dict[str, str] = {
    "1F1B": "single",
    "GPipe": "single",
    "Interleaved1F1B": "multi",
    "InterleavedZeroBubble": "multi",
    "LoopedBFS": "multi",
    "ZBVZeroBubble": "v",
}

# The schedules that split each backward into input-grad and weight-grad actions.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")

# What each stage style needs of stages_per_rank, and how the refusal says it.
_STAGES_RULE = {
    "single": (lambda k: k == 1, "runs exactly 1 stage"),
    "multi": (lambda k: k >= 2, "needs at least 2 stages"),
    "v": (lambda k: k == 2, "runs exactly 2 stages"),
}


def check_pp_microbatches(
    schedule: str, n_microbatches: int, pp_degree: int, stages_per_rank: int | None = None
) -> None:
    """Raise ``ValueError`` if ``schedule`` cannot run ``n_microbatches`` (per optimizer step
    on one DP rank) variable-length ones; ``stages_per_rank`` defaults to torchtitan's."""
    names = {name.lower(): name for name in VARLEN_SCHEDULES}
    if not isinstance(schedule, str) or schedule.lower() not in names:
        raise ValueError(
            f"pipeline_parallel_schedule={schedule!r} is not supported with variable-length "
            f"micro-batches; supported: {sorted(VARLEN_SCHEDULES)}"
        )
    name = names[schedule.lower()]
    style = VARLEN_SCHEDULES[name]
    if not isinstance(pp_degree, int) or pp_degree < 2:
        raise ValueError(f"pipeline_parallel_degree must be an int >= 2, got {pp_degree!r}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"the number of micro-batches must be an int >= 1, got {n_microbatches!r}")
    if stages_per_rank is None:
        stages_per_rank = 1 if style == "single" else 2
    accepts, needs = _STAGES_RULE[style]
    if not accepts(stages_per_rank):
        raise ValueError(f"{name} {needs} per rank, got stages_per_rank={stages_per_rank}")
    if name == "1F1B" and n_microbatches < pp_degree:
        raise ValueError(
            f"1F1B needs at least pipeline_parallel_degree={pp_degree} micro-batches per step, "
            f"got {n_microbatches}"
        )
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pp_degree)
        if n_microbatches % rounds != 0:
            valid = [n for n in range(1, 4 * pp_degree + 1) if n % max(1, n // pp_degree) == 0]
            raise ValueError(
                f"{name} with pipeline_parallel_degree={pp_degree} needs the number of "
                f"micro-batches per step to be a multiple of max(1, n // {pp_degree}) = {rounds}, "
                f"got {n_microbatches}; valid counts up to {4 * pp_degree}: {valid}"
            )
