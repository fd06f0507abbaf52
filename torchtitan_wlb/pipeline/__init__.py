"""Pipeline parallelism with variable-length micro-batches and token-mean loss normalisation."""

from torchtitan_wlb.pipeline.schedule_check import VARLEN_SCHEDULES, check_pp_microbatches
from torchtitan_wlb.pipeline.varlen import (
    IGNORE_INDEX,
    UnsupportedTorchVersionError,
    VarlenPipelineRunner,
    check_torch_version,
    count_valid_tokens,
    global_valid_tokens,
    token_mean_loss,
)

__all__ = [
    "IGNORE_INDEX",
    "UnsupportedTorchVersionError",
    "VARLEN_SCHEDULES",
    "VarlenPipelineRunner",
    "check_pp_microbatches",
    "check_torch_version",
    "count_valid_tokens",
    "global_valid_tokens",
    "token_mean_loss",
]
