"""The ``[wlb]`` TOML section (``[job] custom_config_module``) and its two tables, ``[wlb.online]``
and ``[wlb.advanced]``, checked in ``__post_init__``; their field docs are docs/configuration.md.
No ``from __future__ import annotations``: tyro and TorchTitan's TOML loader read them."""

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

import tyro

from torchtitan_wlb.cost_fit import OnlineFitConfig
from torchtitan_wlb.cp.adaptive import DEFAULT_CP_BANDWIDTH_GBPS, STRATEGIES
from torchtitan_wlb.packing import PACKERS

# What each mode of the paper sets: (packing, cp_sharding); without a mode, "wlb" and "adaptive".
MODE_PRESETS: dict[str, tuple[str, str]] = {
    "plain_4d": ("original", "per_sequence"),
    "fixed_4d": ("fixed_greedy", "per_document"),
    "wlb": ("wlb", "adaptive"),
}
NO_MODE: tuple[str, str] = MODE_PRESETS["wlb"]
PRESET_FIELDS: tuple[str, ...] = ("packing", "cp_sharding")
"""The `[wlb]` fields a mode sets, in the order of a :data:`MODE_PRESETS` entry."""


class FromMode(str):
    """A `packing` or `cp_sharding` value that the mode chose (or the default, without a mode),
    not the user. TorchTitan builds the config twice, from the TOML and then again with the
    command line's values over the first build's: the second build must tell the first one's
    preset values, which a new ``--wlb.mode`` replaces, from values the user set, which win."""


def _choice(*values: str) -> Any:
    """``Literal[values]`` read from the command line as a plain string, so that a bad value gets
    the same :class:`ConfigError` as from TOML (tyro's own rejection names no ``[wlb]`` field)."""
    as_string = tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="{" + ",".join(values) + "}",
        instance_from_str=lambda args: args[0],
        is_instance=lambda value: isinstance(value, str),
        str_from_instance=lambda value: [value],
    )
    return Annotated[Literal[values], as_string]


def choice_values(annotation: Any) -> tuple[str, ...]:
    """The accepted values of a choice field's annotation; empty for other fields."""
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return get_args(annotation) if get_origin(annotation) is Literal else ()


# The choice fields' types, from the registries but for the attention backends, whose registry
# imports torch, which the config (read by the tools too) must not; a test keeps the two equal.
Mode = _choice("", *MODE_PRESETS)
Packing = _choice(*PACKERS)  # or "": the mode's (PRESET_FIELDS)
CPSharding = _choice(*STRATEGIES)
AttentionBackend = _choice("auto", "cpu", "flash", "torch_varlen")
LongDocPolicy = _choice("split", "truncate", "error")
CostModelKind = _choice("analytic", "coefficients", "profile", "online")
Loader = _choice("documents", "torchtitan")


class ConfigError(ValueError):
    """A job config that cannot run; the message names the fields and the accepted values."""


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_type(where: str, value: Any, annotation: Any) -> Any:
    """``value`` as the field's type (TorchTitan passes TOML values unchecked), or a ConfigError
    naming the field (``where``: "[wlb] name") and the type; integers pass for floats, booleans
    only for booleans, and a nested table only as its dataclass."""
    if choice_values(annotation):
        annotation = str
    if get_origin(annotation) is list:
        if isinstance(value, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            return list(value)
        raise ConfigError(f"{where} = {value!r} must be a list of integers, e.g. [1024, 4096]")
    ok = isinstance(value, annotation) and (annotation is bool or not isinstance(value, bool))
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        expected = _TYPE_NAMES.get(annotation) or f"a table, [{annotation.TOML_TABLE}]"
        raise ConfigError(f"{where} = {value!r} is {type(value).__name__}; it must be {expected}")
    return value


# The numeric fields' lower bounds: inclusive (">=") or exclusive (">"), with a note on why.
_LOWEST: dict[str, tuple[str, float, str]] = {
    **dict.fromkeys(("epochs", "max_doc_len", "cp_hybrid_max_len", "micro_batch_max_len",
                     "release_slack", "attn_coef", "linear_coef", "warmup_steps"),
                    (">=", 0, "")),
    **dict.fromkeys(("max_delay_steps", "delay_target", "packing_window", "solver_node_limit",
                     "solver_time_limit_s", "cp_bandwidth_gbps", "interval_steps",
                     "apply_lag_steps", "read_ahead_steps", "initial_attn_scale"),
                    (">", 0, "")),
    "balance_target": (">=", 1.0, ""),
    "peak_tflops": (">=", 0, ""),
    "window_steps": (">=", 2, " (at least one step fitted and one held out)"),
    "shuffle_seed": (">=", -1, " (-1: the corpus order)"),
}  # fmt: skip


def _check_fields(config: Any) -> None:
    """Check the fields of one table (a dataclass with ``TOML_TABLE``) in declaration order: each
    one's type and, for a choice, its value; then the lower bounds of :data:`_LOWEST`."""
    table = config.TOML_TABLE
    for f in fields(config):
        value = _check_type(f"[{table}] {f.name}", getattr(config, f.name), f.type)
        setattr(config, f.name, value)
        accepted = choice_values(f.type)
        unset = value == "" and f.name in PRESET_FIELDS  # the mode's value, set in WLB
        if accepted and value not in accepted and not unset:
            shown = ", ".join(repr(a) for a in accepted)
            raise ConfigError(f"[{table}] {f.name} = {value!r} is not accepted; use one of {shown}")
    for f in fields(config):
        if f.name not in _LOWEST:
            continue
        (op, low, note), value = _LOWEST[f.name], getattr(config, f.name)
        if not math.isfinite(value):  # TOML has nan and inf; no range check catches nan
            raise ConfigError(
                f"[{table}] {f.name} = {value!r} must be a finite number {op} {low}{note}"
            )
        if value < low or (value == low and op == ">"):
            raise ConfigError(
                f"[{table}] {f.name} = {value!r} is out of range; it must be {op} {low}{note}"
            )


@dataclass
class OnlineCostModel:
    """``[wlb.online]``: when the "online" cost model refits and when a refit takes effect, all in
    optimizer steps (the fields of :class:`~torchtitan_wlb.cost_fit.OnlineFitConfig`, by the same
    names and defaults), and the model it starts from."""

    TOML_TABLE: ClassVar[str] = "wlb.online"

    warmup_steps: int = OnlineFitConfig.warmup_steps
    """The first steps' times are not used (allocator and kernel warm-up)."""

    window_steps: int = OnlineFitConfig.window_steps
    """A refit uses the micro-batches of the last this many steps (fewer before that many have
    run since the warm-up)."""

    holdout_steps: int = OnlineFitConfig.holdout_steps
    """The window's newest steps, held out; a refit is adopted only if it predicts them better
    than the model in use. In [1, window_steps)."""

    interval_steps: int = OnlineFitConfig.interval_steps
    """Steps between refits, counted from the first adopted one. The first comes once the
    window's fitted steps hold 8 micro-batch rows per coefficient (32 under CP, else 24), at the
    latest after warmup_steps + window_steps; until one is adopted, every step tries again."""

    apply_lag_steps: int = OnlineFitConfig.apply_lag_steps
    """A refit decided after step s packs step s + this onwards (>= 1), the same step on every DP
    rank and after a resume. 2 packs step s + 2 while step s + 1 trains; 1 puts packing on the
    critical path."""

    initial_attn_scale: float = 1.5
    """Without `[wlb] cost_profile`: until a refit is adopted, the analytic model prices attention
    at this multiple of its FLOPs. Attention kernels run below the matmuls' throughput: fits
    measured 1.3-1.8 times the FLOP ratio on the CPU and an H100 (docs/cost_model.md, "The starting
    model"); 1.0: the FLOP count as is."""

    def __post_init__(self) -> None:
        _check_fields(self)
        if not 1 <= self.holdout_steps < self.window_steps:
            raise ConfigError(
                f"[wlb.online] holdout_steps = {self.holdout_steps} must be >= 1 and less than "
                f"window_steps = {self.window_steps} (the rest of the window is fitted)"
            )


@dataclass
class Advanced:
    """``[wlb.advanced]``: the settings a run rarely changes: the packers' and the CP planner's
    tuning knobs (docs/tuning.md), the attention kernel, the loader and the metrics log."""

    TOML_TABLE: ClassVar[str] = "wlb.advanced"

    attention_backend: AttentionBackend = "auto"
    """Document-masked attention kernel: "auto", "cpu", "flash" (flash-attn varlen, CUDA),
    "torch_varlen" (torch.nn.attention.varlen, CUDA)."""

    reset_positions: bool = True
    """Restart RoPE positions at 0 at every document (False: positions run over the packed
    sequence, as in TorchTitan)."""

    max_doc_len: int = 0
    """Longest document piece in tokens; 0 means `training.seq_len`. Longer documents follow
    `[wlb] long_doc_policy`."""

    loader: Loader = "documents"
    """ "documents": the WLB document pipeline (boundaries reach the model). "torchtitan":
    TorchTitan's own concatenate-and-chop loader, unchanged (no document masking)."""

    cp_hybrid_max_len: int = 0
    """`[wlb] cp_sharding` = "hybrid": the longest document kept whole on one CP rank, in tokens; 0
    chooses it per micro-batch, balanced with the least K/V gathered (docs/context_parallel.md)."""

    cp_bandwidth_gbps: float = DEFAULT_CP_BANDWIDTH_GBPS
    """"adaptive": per-GPU bandwidth of the CP collectives in GB/s, pricing each sharding's K/V
    gather. 50: a CP group across nodes; 200-400 inside one NVLink node; a few for gloo on CPU."""

    adaptive_max_delay_steps: int = 32
    """Upper bound of the adaptive K ("wlb"); equal to `[wlb] max_delay_steps` disables
    adaptation."""

    delay_target: float = 0.38
    """Token-weighted mean delay, in steps, that the adaptive K steers towards ("wlb"); a whole
    pass ends 0.05-0.12 steps above it (the running delay lags), under 0.5 on the benchmarks."""

    balance_target: float = 1.01
    """"wlb" releases a waiting outlier group only if the step's predicted max/mean workload stays
    within this factor (>= 1)."""

    release_slack: float = 0.25
    """"wlb": how much extra imbalance an ageing outlier may accept to leave its queue early
    rather than be forced out alone at K (>= 0)."""

    read_ahead_steps: int = 2
    """"wlb": global batches of documents the data node reads ahead of the packer (>= 1). The
    end of the data is seen this many steps early, and the last steps' documents are drained
    together with the held outliers; each rank keeps their tokens (memory: this many global
    batches of int32 tokens). 1: the end is seen one step early, as for the other packers."""

    packing_window: int = 1
    """Global batches packed together by "fixed_greedy" and "solver" (Table 2's G)."""

    solver_node_limit: int = 200
    """"solver": HiGHS branch-and-bound nodes per packing window. Deterministic: every rank, and a
    resumed run, computes the same plan whatever its load."""

    solver_time_limit_s: float = 60.0
    """"solver": safety net per packing window, in seconds; reaching it before
    `solver_node_limit` stops the run (a plan cut by time depends on the machine's load)."""

    text_field: str = "text"
    """Field holding the document text in jsonl / parquet / Hugging Face datasets."""

    metrics_jsonl: bool = False
    """Also write every logged step's metrics, per rank and at full precision, to
    <dump_folder>/wlb_metrics/rank_<rank>.jsonl."""

    peak_tflops: float = 0.0
    """The device's peak TFLOP/s that the step line's MFU divides by; 0: the dense bf16 peak of
    the GPU by its name (H100, H200, A100, B200; docs/getting_started.md, "tflops and MFU"), and
    no MFU on a CPU or a GPU not in that table."""

    def __post_init__(self) -> None:
        _check_fields(self)
        if not self.text_field:
            raise ConfigError('[wlb.advanced] text_field = "" must name the field holding the text')


@dataclass
class WLB:
    """Workload-balanced packing, per-document context parallelism and the document pipeline: the
    settings a run chooses, then the ``[wlb.online]`` and ``[wlb.advanced]`` tables."""

    TOML_TABLE: ClassVar[str] = "wlb"

    mode: Mode = ""
    """Preset of the paper's configurations for `packing` and `cp_sharding`: "plain_4d"
    (original + per_sequence), "fixed_4d" (fixed_greedy + per_document), "wlb" (wlb + adaptive).
    A `packing` or `cp_sharding` set in the TOML or on the command line wins over the preset."""

    packing: Packing = ""
    """How documents become micro-batches: "original" (TorchTitan-style sequential fill of
    fixed-length sequences), "fixed_greedy", "solver", "wlb" or "wlb_paper". Unset (or ""): the
    mode's, else "wlb"; set, it wins over the mode's."""

    cp_sharding: CPSharding = ""
    """How a micro-batch is split over the CP group: "per_sequence", "per_document", "hybrid"
    (documents up to `[wlb.advanced] cp_hybrid_max_len` whole on one rank, longer ones split),
    "adaptive". Unset (or ""): the mode's, else "adaptive"; set, it wins over the mode's."""

    micro_batch_max_len: int = 0
    """S_max, the token cap of a "wlb" / "wlb_paper" micro-batch (from activation memory); 0 means
    1.25 x `training.seq_len`, else >= it. The fixed-length packers cap at `training.seq_len`."""

    queue_thresholds: list[int] = field(default_factory=list)
    """Outlier queue thresholds L_1 < ... < L_n in tokens ("wlb", "wlb_paper"). Empty: derived
    from the cost model (docs/packing.md); `tools.pack_bench --tune` tunes them on a sample."""

    max_delay_steps: int = 12
    """K: an outlier waits at most this many optimizer steps before it is forced out ("wlb" raises
    it up to `[wlb.advanced] adaptive_max_delay_steps` while the token-weighted delay is under
    `[wlb.advanced] delay_target`)."""

    cost_model: CostModelKind = "analytic"
    """Workload model W(d): "analytic" (model FLOPs), "coefficients" (`attn_coef`, `linear_coef`),
    "profile" (JSON at `cost_profile`), "online" (refitted while training, on the schedule of
    `[wlb.online]`: docs/cost_model.md)."""

    attn_coef: float = 0.0
    """W_a(d) = attn_coef * d^2 when cost_model = "coefficients"."""

    linear_coef: float = 0.0
    """W_l(d) = linear_coef * d when cost_model = "coefficients"."""

    cost_profile: str = ""
    """Path of a measured cost profile (JSON) when cost_model = "profile"."""

    cp_profile: str = ""
    """Attention throughput profile for adaptive CP sharding; empty: the shipped table of this GPU
    (``cp/profiles/*.json`` by device name, then family), else the packaged CPU table."""

    shuffle_seed: int = -1
    """`[training] dataset = "indexed"`: visit the corpus's documents in a seeded permutation, a new
    one each epoch (the same on every rank and after a resume); -1 keeps the corpus order."""

    long_doc_policy: LongDocPolicy = "split"
    """A document longer than `[wlb.advanced] max_doc_len`: "split" into consecutive pieces (no
    token lost), "truncate" (keep the head, count the dropped tokens in the log), "error" (stop)."""

    epochs: int = 0
    """Passes over the dataset; 0 repeats forever. With n > 0 the packing queues are flushed at the
    end of the data and the run stops when it runs out."""

    online: OnlineCostModel = field(default_factory=OnlineCostModel)
    """The `[wlb.online]` table, read when cost_model = "online": when the cost model refits and
    when a refit takes effect, in optimizer steps, and the model it starts from
    (docs/cost_model.md)."""

    advanced: Advanced = field(default_factory=Advanced)
    """The `[wlb.advanced]` table, the settings a run rarely changes: the packers' and the CP
    planner's tuning knobs (docs/tuning.md), the attention kernel, the loader and the metrics
    log."""

    def __post_init__(self) -> None:
        _check_fields(self)
        preset = MODE_PRESETS.get(self.mode, NO_MODE)
        for name, value in zip(PRESET_FIELDS, preset, strict=True):
            if not getattr(self, name) or isinstance(getattr(self, name), FromMode):
                setattr(self, name, FromMode(value))
        adaptive = self.advanced.adaptive_max_delay_steps
        if adaptive < self.max_delay_steps:
            raise ConfigError(
                f"[wlb.advanced] adaptive_max_delay_steps = {adaptive} must be >= [wlb] "
                f"max_delay_steps = {self.max_delay_steps}"
            )
        thresholds = self.queue_thresholds
        if any(b <= a for a, b in zip([0, *thresholds], thresholds, strict=False)):
            raise ConfigError(
                f"[wlb] queue_thresholds = {thresholds!r} must be positive and strictly increasing"
            )
        if self.cost_model == "coefficients" and (self.attn_coef <= 0 or self.linear_coef <= 0):
            raise ConfigError(
                f'[wlb] cost_model = "coefficients" needs attn_coef > 0 and linear_coef > 0 '
                f"(got attn_coef = {self.attn_coef!r}, linear_coef = {self.linear_coef!r})"
            )
        if self.cost_model == "profile" and not self.cost_profile:
            raise ConfigError('[wlb] cost_model = "profile" needs cost_profile = "<path.json>"')

    def preset_overrides(self) -> dict[str, str]:
        """The preset fields set to a value other than the mode's: {name: the mode's value}."""
        if not self.mode:
            return {}
        preset = dict(zip(PRESET_FIELDS, MODE_PRESETS[self.mode], strict=True))
        return {
            name: chosen
            for name, chosen in preset.items()
            if not isinstance(getattr(self, name), FromMode) and getattr(self, name) != chosen
        }

    def online_fit_config(self) -> OnlineFitConfig:
        """The online cost model's refit schedule: the ``[wlb.online]`` fields of the same names."""
        return OnlineFitConfig(
            **{f.name: getattr(self.online, f.name) for f in fields(OnlineFitConfig)}
        )


TABLES: tuple[type, ...] = (WLB, OnlineCostModel, Advanced)
"""The section's tables, ``[wlb]`` first; each one's settings are its :func:`settings`."""


def settings(table: type) -> list[Any]:
    """The fields of ``table`` that are settings, not nested tables (``online``, ``advanced``)."""
    return [f for f in fields(table) if not is_dataclass(f.type)]


@dataclass
class JobConfig:
    """Merged into TorchTitan's JobConfig by ``[job] custom_config_module``."""

    wlb: WLB = field(default_factory=WLB)
