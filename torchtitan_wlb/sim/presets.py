"""Parallel layouts the simulator knows, and the paper's Table 1 configurations.

The models themselves (the paper's 550M/7B/30B/70B and why they have the shapes they have) are in
:mod:`torchtitan_wlb.models.catalogue`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """A 4D parallel layout. Rank order is TP innermost, then CP, PP, DP (the paper's DP > PP > CP > TP).

    Attributes:
        tp: Tensor-parallel degree (with sequence parallelism).
        cp: Context-parallel degree (all-gather KV attention).
        pp: Pipeline-parallel degree (number of physical stages).
        dp: Data-parallel degree (FSDP replicas, each running its own pipeline).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for field_name in ("tp", "cp", "pp", "dp"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"parallel degree {field_name}={value!r} must be a positive integer"
                )

    @property
    def world_size(self) -> int:
        """Number of GPUs the layout uses."""
        return self.tp * self.cp * self.pp * self.dp

    def as_tuple(self) -> tuple[int, int, int, int]:
        """(TP, CP, PP, DP), the paper's notation."""
        return (self.tp, self.cp, self.pp, self.dp)


def resolve_layout(tp: int, cp: int, pp: int, dp: int | None, gpus: int | None) -> Layout:
    """Build a layout, inferring DP from the GPU count when DP is not given.

    Raises ValueError naming the GPU count when the layout's product does not divide it, or when an
    explicit DP makes the product differ from it.
    """
    inner = tp * cp * pp
    if gpus is not None:
        if gpus < 1:
            raise ValueError(f"--gpus {gpus} must be a positive integer")
        if gpus % inner:
            raise ValueError(
                f"parallel layout TP{tp} x CP{cp} x PP{pp} = {inner} does not divide the GPU count {gpus}"
            )
        if dp is None:
            dp = gpus // inner
        elif inner * dp != gpus:
            raise ValueError(
                f"parallel layout TP{tp} x CP{cp} x PP{pp} x DP{dp} = {inner * dp} does not match "
                f"the GPU count {gpus}"
            )
    return Layout(tp=tp, cp=cp, pp=pp, dp=1 if dp is None else dp)


@dataclass(frozen=True)
class PaperConfig:
    """One row of the paper's Table 1.

    Attributes:
        model: Model name in :mod:`torchtitan_wlb.models.catalogue`.
        context_len: Context window in tokens.
        layout: (TP, CP, PP, DP) used in the paper.
    """

    model: str
    context_len: int
    layout: Layout


K = 1024
PAPER_TABLE1: tuple[PaperConfig, ...] = (
    PaperConfig("550M", 64 * K, Layout(2, 2, 4, 2)),
    PaperConfig("550M", 128 * K, Layout(2, 4, 4, 1)),
    PaperConfig("7B", 64 * K, Layout(4, 2, 4, 1)),
    PaperConfig("7B", 128 * K, Layout(8, 2, 4, 1)),
    PaperConfig("30B", 64 * K, Layout(8, 2, 4, 1)),
    PaperConfig("30B", 128 * K, Layout(8, 4, 4, 1)),
    PaperConfig("70B", 64 * K, Layout(16, 4, 4, 1)),
    PaperConfig("70B", 128 * K, Layout(16, 4, 4, 1)),
)
