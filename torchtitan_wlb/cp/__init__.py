"""Context parallelism for packed documents: sharding plans, profile tables and the CP attention op.

``plan`` and ``profile`` are pure NumPy (no torch import at module load); the op lives in ``cp.op``
and is imported lazily by ``CPPlan.attention_metadata`` and ``attention_from_metadata``.
"""

from torchtitan_wlb.cp.plan import STRATEGIES, CPPlan, LocalAttentionSpec, build_cp_plan
from torchtitan_wlb.cp.profile import CPProfile, default_profile, resolve_profile

__all__ = [
    "STRATEGIES",
    "CPPlan",
    "CPProfile",
    "LocalAttentionSpec",
    "build_cp_plan",
    "default_profile",
    "resolve_profile",
]
