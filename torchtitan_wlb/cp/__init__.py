"""Context parallelism for packed documents: sharding plans, profile tables and the CP attention op.

``plan``, ``profile`` and ``adaptive`` import no torch at module load; the op (``cp.op``) and the
tensors a rank feeds it (``cp.local``) are imported where a process group exists.
"""

from torchtitan_wlb.cp.adaptive import build_cp_plan
from torchtitan_wlb.cp.profile import CPProfile, default_profile

__all__ = ["CPProfile", "build_cp_plan", "default_profile"]
