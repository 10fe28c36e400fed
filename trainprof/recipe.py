"""Recipes: typed nested dataclasses loaded from YAML, key=value overrides, and every validation rule.

A recipe is plain data. `load_recipe(path, overrides)` returns a validated `Recipe` or raises
`RecipeError`, whose message is one line naming the key and what to do. Rules that depend on the
machine (CUDA, installed packages) live in `check_environment`, called by the runner only, so that
`trainprof plan` works for a GPU recipe on a laptop.
"""

from __future__ import annotations

import dataclasses
import functools
import difflib
import importlib.util
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainprof.shapes import DIM_KEYS, SHAPES, LlamaShape, shape_from_checkpoint

Dtype = Literal["bf16", "fp16", "fp32"]


class RecipeError(ValueError):
    """A mistake in a recipe or an override; the message is one line: key, problem, what to do."""


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "llama2-tiny"  # a shape from trainprof.shapes.SHAPES, or "custom" with every dim below
    hidden_size: int | None = None  # explicit dims override the named shape (naming a shape drops custom's)
    intermediate_size: int | None = None  # MLP width
    num_layers: int | None = None  # decoder layers
    num_heads: int | None = None  # attention (query) heads
    num_kv_heads: int | None = None  # < num_heads means grouped-query attention (Llama2-70B: 8)
    vocab_size: int | None = None  # tokens in the embedding and LM head
    max_position_embeddings: int | None = None  # longest sequence the RoPE tables cover
    dtype: Dtype = "bf16"  # parameter/compute dtype for training
    checkpoint: str | None = None  # local HF checkpoint dir; None = random init (never a download)
    attention: Literal["eager", "sdpa", "flash2"] = "sdpa"  # transformers attn_implementation
    recompute: bool = False  # activation recomputation (gradient checkpointing per decoder layer)
    compile: bool = False  # torch.compile each decoder layer (torchtitan style, inductor); modules inside a layer are then timed with it


@dataclass(kw_only=True)
class LoraConfig:
    r: int = 8  # adapter rank
    alpha: int = 16  # scaling numerator: adapters are scaled by alpha / r
    dropout: float = 0.05  # dropout on the adapter input, in [0, 1)
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])  # Llama linear names


@dataclass(kw_only=True)
class QuantConfig:
    quant_type: Literal["nf4", "fp4"] = "nf4"  # bitsandbytes 4-bit data type
    double_quant: bool = True  # quantize the quantization constants too (QLoRA paper, sec. 3)
    compute_dtype: Dtype = "bf16"  # dtype the 4-bit weights are dequantized to for matmuls


@dataclass(kw_only=True)
class TaskConfig:
    kind: Literal["pretrain", "lora", "qlora"] = "pretrain"  # qlora = lora on a 4-bit base
    lora: LoraConfig = field(default_factory=LoraConfig)  # used by lora and qlora
    quant: QuantConfig = field(default_factory=QuantConfig)  # used by qlora


@dataclass(kw_only=True)
class DataConfig:
    source: Literal["synthetic", "file"] = "synthetic"  # synthetic tokens, or a local text file
    path: str | None = None  # local .txt or .jsonl (field "text") when source=file
    tokenizer: str | None = None  # local tokenizer dir when source=file
    seq_len: int = 350  # tokens per sample; 350 is the length Zhang et al. (arXiv 2311.03687) measured with
    synthetic_pattern_len: int = 64  # synthetic data repeats a random pattern this long (learnable)
    num_workers: int = 0  # torch DataLoader workers


@dataclass(kw_only=True)
class TrainConfig:
    micro_batch_size: int = 1  # samples per rank per forward
    grad_accum: int = 1  # micro batches per optimizer step (pipeline stages: the micro batches the schedule runs)
    steps: int = 10  # measured optimizer steps
    warmup_steps: int = 2  # optimizer steps run before measuring
    seed: int = 1234  # seeds Python, NumPy and torch on every rank (model init, data)
    memory_cap_gb: float | None = None  # per-rank memory cap: GPU allocator cap; CPU peak RSS checked per step
    cpu_allocator: Literal["cache", "system"] = "cache"  # CPU runs: cache keeps freed host memory in the process (glibc mallopt), as a GPU's caching allocator does, so steps do not page-fault their tensors in again; system: the C library's defaults


@dataclass(kw_only=True)
class EngineConfig:
    kind: Literal["deepspeed", "torch", "fsdp", "megatron"] = "deepspeed"  # torch = single process or DDP; fsdp = PyTorch FSDP2 (fully_shard per decoder layer and the root); megatron = megatron-core GPTModel (CUDA only)
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    offload: Literal["none", "optimizer", "optimizer+params"] = "none"  # ZeRO-Offload to CPU; fsdp: optimizer+params = FSDP2's CPUOffloadPolicy
    reshard_after_forward: bool = True  # engine.kind fsdp, the decoder layers: free gathered parameters after forward (ZeRO-3-like); false keeps them for backward (ZeRO-2-like); the root always keeps them (FSDP2's default)
    pipeline_stages: int = 1  # > 1: one pipeline stage per rank (torch.distributed.pipelining, engine.kind torch); must equal the number of ranks
    pipeline_schedule: Literal["gpipe", "1f1b"] = "gpipe"  # pipeline schedule over train.grad_accum micro batches
    pipeline_layers: list[int] | None = None  # decoder layers per stage, e.g. [3, 1]; None = even split, extra layers to the first stages
    tensor_parallel: int = 1  # megatron: ranks that split each layer's matrices (Megatron TP); 1 = off
    pipeline_parallel: int = 1  # megatron: ranks that split the decoder layers (Megatron 1F1B pipeline); 1 = off
    distributed_optimizer: bool | None = None  # megatron: shard fp32 master weights + Adam states over data-parallel ranks; null = on
    megatron_recompute: Literal["full", "selective"] | None = None  # megatron, with model.recompute: full = every layer (null), selective = core attention only


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"  # AdamW (DeepSpeed's, or torch.optim's for engine torch)
    state_bits: Literal[32, 8, 4] = 32  # Adam moments: 32 = fp32; 8/4 = torchao block-quantized states, all params train
    lr: float = 1e-4  # constant learning rate
    weight_decay: float = 0.0  # decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam (beta1, beta2)
    eps: float = 1e-8  # Adam epsilon
    grad_clip: float = 1.0  # max global grad norm; 0 disables


@dataclass(kw_only=True)
class ProfileConfig:
    enabled: bool = True  # hook-based step profiler on every measured step
    module_depth: int = 4  # deepest module level timed (0 = LlamaForCausalLM; 4 = attention, MLP, norms)
    ops: bool = False  # operator level (torch.profiler) on the steps in ops_steps
    ops_steps: int = 2  # measured steps traced at operator level when ops is on (torch.profiler active)
    trace_wait: int = 0  # measured steps to skip before operator tracing starts (torch.profiler wait)
    trace_warmup: int = 1  # steps traced then discarded before the ops_steps (Kineto warm-up); not in medians
    record_shapes: bool = False  # operator input shapes (and per-operator FLOPs) in traces; larger traces
    with_stack: bool = False  # Python stack per operator in traces; much larger traces
    trace_gzip: bool = True  # traces as .pt.trace.json.gz (TensorBoard, Perfetto and HTA read them)
    calibrate: bool = True  # after training: matmul, memory and collective microbenchmarks (seconds) -> calibration.json
    telemetry_period_ms: float = 50.0  # NVML telemetry sampling period on CUDA (clocks, power, PCIe, NVLink); 0 = off


@dataclass(kw_only=True)
class OutputConfig:
    dir: str = "runs"  # run dirs go to <dir>/<name>-<UTC timestamp>/
    name: str | None = None  # default: the recipe file's stem


@dataclass(kw_only=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    deepspeed: dict[str, Any] = field(default_factory=dict)  # passed verbatim to DeepSpeed

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# DeepSpeed's ZeRO defaults (deepspeed/runtime/zero/config.py; tests/test_recipe.py checks them against the
# installed DeepSpeed) for readers that must not import DeepSpeed: a parameter of at most
# stage3_param_persistence_threshold elements stays whole on every rank (gathered once after each step); one
# fetched in forward is kept while it is reused within stage3_max_reuse_distance parameters; gradients are
# reduced in buckets of reduce_bucket_size elements.
DEEPSPEED_ZERO_DEFAULTS: dict[str, int] = {
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "reduce_bucket_size": 500_000_000,
}


# DeepSpeed config keys that trainprof derives from recipe keys: setting one in `deepspeed:` too is
# ambiguous, so it is an error naming both.
DEEPSPEED_KEYS_FROM_RECIPE: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "train_batch_size": "train.micro_batch_size",
    "zero_optimization.stage": "engine.zero_stage",
    "zero_optimization.offload_optimizer": "engine.offload",
    "zero_optimization.offload_param": "engine.offload",
    "bf16": "model.dtype",
    "fp16": "model.dtype",
    "optimizer": "optimizer",
    "gradient_clipping": "optimizer.grad_clip",
    "seed": "train.seed",
}


# ---------------------------------------------------------------------------------------------
# Loading: dict -> dataclasses, with unknown-key and type checks
# ---------------------------------------------------------------------------------------------


def did_you_mean(key: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(options))}"


def _section_of(key: str) -> tuple[type, str]:
    """The deepest recipe section a dotted key names (Recipe itself where its first part is no section),
    with that section's dotted prefix."""
    cls, prefix = Recipe, ""
    for part in key.split(".")[:-1]:
        tp = _type_hints(cls).get(part)
        if not dataclasses.is_dataclass(tp):
            break
        cls, prefix = tp, f"{prefix}{part}."
    return cls, prefix


def recipe_key_hint(key: str) -> str:
    """What to write instead of an unknown dotted recipe key: the nearest full dotted key (within the
    section it names, else a leaf of that name elsewhere), else only the keys of the section it names (the
    top-level sections where it names none), not every key."""
    cls, prefix = _section_of(key)
    rest = key[len(prefix):]
    own = [f.name for f in dataclasses.fields(cls)] + list(_leaf_keys(cls, ""))
    close = [prefix + c for c in difflib.get_close_matches(rest, own, n=1, cutoff=0.6)]
    if not close:  # a leaf in the wrong section, or a bare leaf (micro_batch_sze): the leaf's full key
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in _leaf_keys(Recipe, "")}
        close = [by_leaf[c] for c in difflib.get_close_matches(rest.rsplit(".", 1)[-1], by_leaf, n=1, cutoff=0.8)]
    if close:
        return f"; did you mean '{close[0]}'?"
    keys = ", ".join(sorted(f"{prefix}{f.name}" for f in dataclasses.fields(cls)))
    return f"; keys of section '{prefix[:-1]}': {keys}" if prefix else f"; the top-level sections are {keys}"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against type `tp` (as written in the dataclass); return it, ints widened to float."""
    origin = typing.get_origin(tp)
    bad = RecipeError(f"recipe key '{key}': expected {_type_name(tp)}, got {value!r}; fix the value")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except RecipeError:
                pass
        raise bad
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise RecipeError(
                f"recipe key '{key}': {value!r} is not one of {_type_name(tp)}; pick one of those"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise TypeError(f"unsupported recipe field type {tp!r} at {key}")  # a bug in this module


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:  # resolving the annotations is most of a build's time
    return typing.get_type_hints(cls)


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        where = f"section '{prefix}'" if prefix else "the recipe"
        raise RecipeError(f"{where} must be a mapping of keys to values, got {data!r}")
    hints = _type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise RecipeError(f"unknown recipe key '{full}'{recipe_key_hint(full)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def leaf_keys(cls: type = Recipe, prefix: str = "") -> dict[str, Any]:
    """Every dotted leaf key of a recipe dataclass, mapped to its type (a copy: callers may change it)."""
    return dict(_leaf_keys(cls, prefix))


@functools.lru_cache(maxsize=None)
def _leaf_keys(cls: type, prefix: str) -> dict[str, Any]:  # the dataclasses do not change: once each
    out: dict[str, Any] = {}
    for name, tp in _type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out.update(_leaf_keys(tp, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = tp
    return out


def _resolve_override_key(key: str) -> str:
    """`train.micro_batch_size` stays; a bare leaf name (`zero_stage`) resolves if it is unique."""
    if key.startswith("deepspeed."):
        return key
    leaves = leaf_keys()
    if key in leaves:
        return key
    if "." not in key:
        matches = [k for k in leaves if k.rsplit(".", 1)[-1] == key]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise RecipeError(f"override '{key}' is ambiguous: write one of {', '.join(matches)}")
    raise RecipeError(f"unknown recipe key '{key}' in override{recipe_key_hint(key)}")


def override_key(item: str) -> str:
    """The dotted recipe key a `key=value` override sets (a bare leaf name resolved as apply_overrides does)."""
    if "=" not in item:
        raise RecipeError(f"override '{item}' must look like key=value (e.g. engine.zero_stage=2)")
    return _resolve_override_key(item.split("=", 1)[0].strip())


def apply_overrides(data: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` strings to a raw recipe dict; values are parsed as YAML scalars.

    A `custom` model's dims define its shape rather than adjust a named one, so an override that names a
    shape instead (model.name=llama2-70b) drops them, except the dims the overrides set themselves: a
    wrapped run's recorded model is `custom`, and a buyer asks it for a named size."""
    was_custom = (data.get("model") or {}).get("name") == "custom"
    for item in overrides:
        key, raw_value = override_key(item), item.split("=", 1)[1]
        try:
            value = yaml.safe_load(raw_value) if raw_value.strip() else None
        except yaml.YAMLError:
            value = raw_value
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    model = data.get("model") or {}
    if was_custom and model.get("name") != "custom":
        named = {override_key(item) for item in overrides}
        for key in DIM_KEYS:
            if f"model.{key}" not in named:
                model.pop(key, None)
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    from trainprof.io import read_yaml as read_yaml_file

    data = read_yaml_file(path, what="recipe file", hint="pass a YAML recipe file, e.g. recipes/quickstart_cpu.yaml",
                          error=RecipeError)
    if data is None:  # 0 bytes or only comments: almost surely the wrong file, not "all defaults"
        raise RecipeError(f"recipe file '{path}' is empty; give the recipe's keys, or write {{}} in it "
                          "to mean all defaults")
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file '{path}' must hold a YAML mapping of keys (got {type(data).__name__})")
    return data


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    recipe = _build(Recipe, data, "")
    validate(recipe)
    return recipe


def load_recipe(path: str | Path, overrides: typing.Sequence[str] = (), *,
                before_validation: typing.Callable[[dict[str, Any]], None] | None = None) -> Recipe:
    """Read a YAML recipe, apply overrides, build the typed recipe and validate it; `before_validation` may
    change the overridden data first (infer replaces the engine section by the one process it runs)."""
    data = apply_overrides(read_yaml(path), overrides)
    if before_validation is not None:
        before_validation(data)
    recipe = recipe_from_dict(data)
    if recipe.output.name is None:
        recipe.output.name = Path(path).stem
    return recipe


# ---------------------------------------------------------------------------------------------
# Validation: static rules (the recipe alone)
# ---------------------------------------------------------------------------------------------


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out[f"{prefix}{k}"] = v
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
    return out


def shape_label(cfg: ModelConfig) -> str:
    """The model's name with the dims its recipe sets away from the named shape, e.g. "llama2-7b
    (num_layers 2)": a run made with explicit dims keeps them when another shape is named."""
    if cfg.checkpoint is not None or cfg.name not in SHAPES:
        return cfg.name
    named = SHAPES[cfg.name]
    moved = [f"{k} {getattr(cfg, k)}" for k in DIM_KEYS
             if getattr(cfg, k) is not None and getattr(cfg, k) != getattr(named, k)]
    return f"{cfg.name} ({', '.join(moved)})" if moved else cfg.name


def resolve_shape(cfg: ModelConfig) -> LlamaShape:
    """The shape a model config asks for: a checkpoint's config.json, else a named shape with explicit
    dims laid over it. Raises RecipeError for missing or inconsistent dims."""
    if cfg.checkpoint is not None:
        base = shape_from_checkpoint(cfg.checkpoint)
    elif cfg.name == "custom":
        missing = [k for k in DIM_KEYS[:5] if getattr(cfg, k) is None]
        if missing:
            raise RecipeError(
                f"recipe key 'model.{missing[0]}' is required when model.name is 'custom'; set every dim "
                f"({', '.join(DIM_KEYS[:5])}) or pick a named shape"
            )
        base = LlamaShape(name="custom", **{k: getattr(cfg, k) for k in DIM_KEYS[:5]})
    else:
        base = SHAPES[cfg.name]
    explicit = {k: getattr(cfg, k) for k in DIM_KEYS if getattr(cfg, k) is not None}
    shape = dataclasses.replace(base, **explicit)
    for key in DIM_KEYS:
        if getattr(shape, key) < 1:
            raise RecipeError(f"recipe key 'model.{key}': {getattr(shape, key)} must be >= 1")
    if shape.hidden_size % shape.num_heads:
        raise RecipeError(
            f"recipe key 'model.num_heads': {shape.num_heads} does not divide hidden_size {shape.hidden_size}"
        )
    if shape.num_heads % shape.num_kv_heads:
        raise RecipeError(
            f"recipe key 'model.num_kv_heads': {shape.num_kv_heads} does not divide num_heads {shape.num_heads}"
        )
    return shape



def _require(cond: bool, message: str) -> None:
    if not cond:
        raise RecipeError(message)


def validate(recipe: Recipe) -> None:
    """Every rule that needs only the recipe (and local paths), in RULES order: the first one broken
    raises RecipeError naming its key."""
    for rule in RULES:
        rule(recipe)


def _check_model(recipe: Recipe) -> None:
    """A known shape (or custom dims that resolve), and a local checkpoint dir when one is named."""
    m = recipe.model
    _require(
        m.name in SHAPES or m.name == "custom",
        f"recipe key 'model.name': unknown shape {m.name!r}{did_you_mean(m.name, [*SHAPES, 'custom'])}",
    )
    if m.checkpoint is not None:
        ckpt = Path(m.checkpoint)
        _require(
            (ckpt / "config.json").is_file(),
            f"recipe key 'model.checkpoint': '{ckpt}' has no config.json; give a local Hugging Face "
            "checkpoint dir or remove the key for random init",
        )
    resolve_shape(m)  # raises RecipeError for missing/inconsistent dims


def _check_data(recipe: Recipe) -> None:
    """Sequence length within the model's positions; a local text file and tokenizer for source file."""
    m, d = recipe.model, recipe.data
    shape = resolve_shape(m)
    _require(d.seq_len >= 2, "recipe key 'data.seq_len' must be >= 2")
    _require(
        d.seq_len <= shape.max_position_embeddings,
        f"recipe key 'data.seq_len': {d.seq_len} exceeds the model's max_position_embeddings "
        f"{shape.max_position_embeddings}; lower data.seq_len or raise model.max_position_embeddings",
    )
    _require(d.synthetic_pattern_len >= 1, "recipe key 'data.synthetic_pattern_len' must be >= 1")
    _require(d.num_workers >= 0, "recipe key 'data.num_workers' must be >= 0")
    if d.source != "file":
        return
    _require(d.path is not None, "recipe key 'data.path' is required when data.source is 'file'")
    _require(
        Path(d.path).is_file(),
        f"recipe key 'data.path': file '{d.path}' not found; give a local .txt or .jsonl file",
    )
    _require(
        Path(d.path).suffix in (".txt", ".jsonl"),
        f"recipe key 'data.path': '{d.path}' must end in .txt or .jsonl",
    )
    tok = d.tokenizer or m.checkpoint
    _require(
        tok is not None,
        "recipe key 'data.tokenizer' is required for data.source 'file' (a local tokenizer dir)",
    )
    _require(
        Path(tok).is_dir(),
        f"recipe key 'data.tokenizer': '{tok}' is not a local directory; give a local tokenizer dir",
    )


def _check_ranges(recipe: Recipe) -> None:
    """Counts and sizes within their ranges."""
    tr, p = recipe.train, recipe.profile
    for key, value, low in (
        ("train.micro_batch_size", tr.micro_batch_size, 1),
        ("train.grad_accum", tr.grad_accum, 1),
        ("train.steps", tr.steps, 1),
        ("train.warmup_steps", tr.warmup_steps, 0),
        ("profile.module_depth", p.module_depth, 0),
        ("profile.ops_steps", p.ops_steps, 1),
        ("profile.trace_wait", p.trace_wait, 0),
        ("profile.trace_warmup", p.trace_warmup, 0),
        ("profile.telemetry_period_ms", p.telemetry_period_ms, 0),
    ):
        _require(value >= low, f"recipe key '{key}': {value} is out of range; it must be >= {low}")
    _require(
        0 <= recipe.engine.zero_stage <= 3,
        f"recipe key 'engine.zero_stage': {recipe.engine.zero_stage} is out of range; use 0, 1, 2 or 3",
    )
    _require(
        tr.memory_cap_gb is None or tr.memory_cap_gb > 0,
        f"recipe key 'train.memory_cap_gb': {tr.memory_cap_gb} must be > 0 (or null for no cap)",
    )


def _check_optimizer(recipe: Recipe) -> None:
    """AdamW's settings, and what quantized optimizer states cannot combine with."""
    o, e, tr = recipe.optimizer, recipe.engine, recipe.train
    _require(o.lr > 0, f"recipe key 'optimizer.lr': {o.lr} must be > 0")
    _require(o.grad_clip >= 0, f"recipe key 'optimizer.grad_clip': {o.grad_clip} must be >= 0 (0 disables)")
    _require(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        f"recipe key 'optimizer.betas': {o.betas} must be two numbers in [0, 1)",
    )
    _require(o.eps > 0, f"recipe key 'optimizer.eps': {o.eps} must be > 0")
    if o.state_bits == 32:
        return
    _require(
        e.offload == "none",
        f"recipe key 'optimizer.state_bits': {o.state_bits}-bit states cannot combine with engine.offload="
        f"{e.offload} (ZeRO-Offload runs DeepSpeed's own fp32 CPU Adam); set optimizer.state_bits=32 or "
        "engine.offload=none",
    )
    _require(
        tr.warmup_steps >= 1,
        f"recipe key 'train.warmup_steps': {o.state_bits}-bit optimizer states compile their update on the "
        "first optimizer step; set train.warmup_steps >= 1 so compilation is not measured",
    )


def _check_engine(recipe: Recipe) -> None:
    """ZeRO and offload need DeepSpeed; parameter offload needs stage 3."""
    e = recipe.engine
    if e.kind == "torch":
        _require(
            e.zero_stage == 0,
            f"recipe key 'engine.zero_stage': ZeRO stage {e.zero_stage} needs engine.kind deepspeed; "
            "set engine.kind=deepspeed or engine.zero_stage=0",
        )
        _require(
            not recipe.deepspeed,
            "recipe section 'deepspeed' is only used by engine.kind deepspeed; remove it or set engine.kind=deepspeed",
        )
    if e.offload != "none" and e.kind != "fsdp":  # FSDP2's offload: _check_fsdp
        _require(
            e.kind == "deepspeed" and e.zero_stage >= 1,
            f"recipe key 'engine.offload': offload '{e.offload}' needs DeepSpeed ZeRO (stage 1-3); "
            "set engine.zero_stage (and engine.kind=deepspeed) or engine.offload=none",
        )
    if e.offload == "optimizer+params" and e.kind != "fsdp":
        _require(
            e.zero_stage == 3,
            "recipe key 'engine.offload': parameter offload needs ZeRO stage 3; "
            "set engine.zero_stage=3 or engine.offload=optimizer",
        )


def _check_pipeline(recipe: Recipe) -> None:
    _validate_pipeline(recipe, resolve_shape(recipe.model))


def _check_lora(recipe: Recipe) -> None:
    """Adapter rank, scale, dropout and the Llama linear layers they attach to."""
    if recipe.task.kind not in ("lora", "qlora"):
        return
    lo = recipe.task.lora
    _require(lo.r >= 1, f"recipe key 'task.lora.r': {lo.r} must be >= 1")
    _require(lo.alpha >= 1, f"recipe key 'task.lora.alpha': {lo.alpha} must be >= 1")
    _require(0 <= lo.dropout < 1, f"recipe key 'task.lora.dropout': {lo.dropout} must be in [0, 1)")
    known = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    _require(len(lo.target_modules) > 0, "recipe key 'task.lora.target_modules' must name at least one module")
    for name in lo.target_modules:
        _require(
            name in known,
            f"recipe key 'task.lora.target_modules': {name!r} is not a Llama linear layer"
            f"{did_you_mean(name, known)}",
        )


def _check_qlora(recipe: Recipe) -> None:
    """4-bit weights cannot be partitioned: only the ZeRO stages that leave them whole."""
    e = recipe.engine
    if recipe.task.kind != "qlora":
        return
    _require(
        e.zero_stage in QLORA_ZERO_STAGES,
        f"recipe key 'engine.zero_stage': qlora with ZeRO stage {e.zero_stage} is not supported by the "
        f"installed bitsandbytes/DeepSpeed (4-bit weights cannot be partitioned); use engine.zero_stage "
        f"in {sorted(QLORA_ZERO_STAGES)}",
    )
    _require(
        e.offload == "none" or e.zero_stage in QLORA_ZERO_STAGES,
        "recipe key 'engine.offload': offload with qlora needs a ZeRO stage qlora supports",
    )


def _check_deepspeed_section(recipe: Recipe) -> None:
    """The verbatim deepspeed: section may not set what a recipe key derives."""
    flat = _flatten(recipe.deepspeed) if recipe.deepspeed else {}
    for ds_key, recipe_key in DEEPSPEED_KEYS_FROM_RECIPE.items():
        _require(
            ds_key not in flat,
            f"recipe key 'deepspeed.{ds_key}' conflicts with '{recipe_key}', which sets it; "
            f"remove it from the deepspeed section and set {recipe_key}",
        )


def _check_output(recipe: Recipe) -> None:
    _require(
        recipe.output.name is None or ("/" not in recipe.output.name and recipe.output.name.strip() != ""),
        f"recipe key 'output.name': {recipe.output.name!r} must be a plain name without '/'",
    )


def _check_megatron(recipe: Recipe) -> None:
    """The Megatron-only keys, and what engine.kind megatron cannot run or split."""
    _validate_megatron_keys(recipe)
    if recipe.engine.kind == "megatron":
        _validate_megatron_combination(recipe)
        _validate_megatron_split(recipe, resolve_shape(recipe.model))


def _check_fsdp(recipe: Recipe) -> None:
    """engine.kind fsdp (FSDP2 fully_shard): what trainprof's FSDP2 engine runs."""
    e, o = recipe.engine, recipe.optimizer
    if e.kind != "fsdp":
        return
    _require(
        e.zero_stage == 0,
        f"recipe key 'engine.zero_stage': ZeRO stage {e.zero_stage} is DeepSpeed's; FSDP2 shards every parameter "
        "itself (engine.reshard_after_forward=true is ZeRO-3-like, false ZeRO-2-like); set engine.zero_stage=0",
    )
    _require(
        not recipe.deepspeed,
        "recipe section 'deepspeed' is only used by engine.kind deepspeed; remove it or set engine.kind=deepspeed",
    )
    _require(
        e.offload in ("none", "optimizer+params"),
        f"recipe key 'engine.offload': FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer states "
        f"together, not '{e.offload}' alone; set engine.offload=optimizer+params or none",
    )
    _require(
        o.state_bits == 32,
        f"recipe key 'optimizer.state_bits': {o.state_bits}-bit optimizer states are not run on FSDP2's sharded "
        "(DTensor) parameters; set optimizer.state_bits=32 or engine.kind=torch",
    )
    _require(
        recipe.task.kind != "qlora",
        "recipe key 'task.kind': qlora's 4-bit base weights cannot be sharded by FSDP2 (bitsandbytes Params4bit); "
        "set task.kind=lora or engine.kind=torch",
    )
    _require(
        recipe.model.dtype != "fp16",
        "recipe key 'model.dtype': fp16 with engine.kind fsdp is not supported (no sharded gradient scaler); "
        "use model.dtype=bf16 or fp32",
    )


def _check_reshard(recipe: Recipe) -> None:
    """engine.reshard_after_forward is FSDP2's: false elsewhere would be silently ignored."""
    _require(
        recipe.engine.reshard_after_forward or recipe.engine.kind == "fsdp",
        f"recipe key 'engine.reshard_after_forward': false is an FSDP2 setting and engine.kind is "
        f"{recipe.engine.kind}; set engine.kind=fsdp or remove the key (DeepSpeed: engine.zero_stage=2 keeps "
        "parameters whole)",
    )


# engines whose model.compile trainprof runs: DeepSpeed's ZeRO-3 partitions parameters in hooks on every
# module (inside each compiled layer) and pipeline stages rebuild the model
COMPILE_ZERO_STAGES = frozenset({0, 1, 2})


def _check_compile(recipe: Recipe) -> None:
    """model.compile (torch.compile per decoder layer): the combinations trainprof runs compiled."""
    e = recipe.engine
    if not recipe.model.compile:
        return
    _require(
        recipe.task.kind != "qlora",
        "recipe key 'model.compile': bitsandbytes' 4-bit layers (task.kind qlora) are not compiled by trainprof; "
        "set model.compile=false or task.kind=lora",
    )
    _require(
        e.pipeline_stages == 1,
        f"recipe key 'model.compile': compiled decoder layers are not combined with engine.pipeline_stages="
        f"{e.pipeline_stages}; set model.compile=false or engine.pipeline_stages=1",
    )
    _require(
        e.kind != "deepspeed" or e.zero_stage in COMPILE_ZERO_STAGES,
        f"recipe key 'model.compile': DeepSpeed ZeRO-3 gathers parameters in hooks inside each compiled layer; "
        f"set model.compile=false, engine.zero_stage in {sorted(COMPILE_ZERO_STAGES)} or engine.kind=fsdp",
    )


# validate() runs these in order; the first broken rule is the one error the user sees
RULES = (_check_model, _check_data, _check_ranges, _check_optimizer, _check_engine, _check_pipeline, _check_megatron,
         _check_fsdp, _check_reshard, _check_compile, _check_lora, _check_qlora, _check_deepspeed_section,
         _check_output)


def _validate_pipeline(recipe: Recipe, shape: LlamaShape) -> None:
    """Pipeline parallelism (engine.pipeline_stages > 1): what torch.distributed.pipelining and
    trainprof's stage split can run. The rank count is checked by `check_world_size`."""
    e, tr = recipe.engine, recipe.train
    _require(e.pipeline_stages >= 1,
             f"recipe key 'engine.pipeline_stages': {e.pipeline_stages} is out of range; it must be >= 1")
    if e.pipeline_stages == 1:
        return
    p = e.pipeline_stages
    _require(
        e.kind == "torch",
        f"recipe key 'engine.pipeline_stages': {p} stages run on torch.distributed.pipelining (engine.kind torch), "
        "which trainprof does not combine with DeepSpeed or ZeRO; set engine.kind=torch and engine.zero_stage=0, "
        "or engine.pipeline_stages=1",
    )
    _require(
        shape.num_layers >= p,
        f"recipe key 'engine.pipeline_stages': {p} stages need at least {p} decoder layers (the model has "
        f"{shape.num_layers}); lower engine.pipeline_stages or raise model.num_layers",
    )
    _require(
        recipe.task.kind == "pretrain",
        f"recipe key 'task.kind': {recipe.task.kind} with engine.pipeline_stages={p} is not supported (the "
        "stage split handles the plain Llama, not peft's wrapper); set task.kind=pretrain or engine.pipeline_stages=1",
    )
    _require(
        recipe.model.dtype != "fp16",
        f"recipe key 'model.dtype': fp16 with engine.pipeline_stages={p} is not supported (no loss scaling "
        "across stages); use model.dtype=bf16 or fp32",
    )
    if e.pipeline_layers is not None:
        _require(
            len(e.pipeline_layers) == p and all(n >= 1 for n in e.pipeline_layers)
            and sum(e.pipeline_layers) == shape.num_layers,
            f"recipe key 'engine.pipeline_layers': {e.pipeline_layers} must list {p} counts >= 1 (one per stage) "
            f"that add up to the model's {shape.num_layers} decoder layers; fix the list or remove it for an even split",
        )
    if e.pipeline_schedule == "1f1b":
        _require(
            tr.grad_accum >= p,
            f"recipe key 'train.grad_accum': 1F1B needs at least as many micro batches as stages "
            f"({tr.grad_accum} < {p}); raise train.grad_accum to >= {p} or use engine.pipeline_schedule=gpipe",
        )


MEGATRON_ONLY_KEYS = ("tensor_parallel", "pipeline_parallel", "distributed_optimizer", "megatron_recompute")
MEGATRON_KEY_DEFAULTS = {"tensor_parallel": 1, "pipeline_parallel": 1, "distributed_optimizer": None,
                         "megatron_recompute": None}


def _validate_megatron_keys(recipe: Recipe) -> None:
    """The engine.* keys only the Megatron engine reads: set on another engine, they would be ignored."""
    e = recipe.engine
    for key in MEGATRON_ONLY_KEYS:
        value = getattr(e, key)
        if key in ("tensor_parallel", "pipeline_parallel"):
            _require(value >= 1, f"recipe key 'engine.{key}': {value} is out of range; it must be >= 1")
        _require(
            e.kind == "megatron" or value == MEGATRON_KEY_DEFAULTS[key],
            f"recipe key 'engine.{key}': {value!r} is read by engine.kind megatron only (this recipe runs "
            f"{e.kind}); set engine.kind=megatron or remove engine.{key}",
        )
    _require(
        e.megatron_recompute is None or recipe.model.recompute,
        f"recipe key 'engine.megatron_recompute': {e.megatron_recompute} picks how model.recompute recomputes; "
        "set model.recompute=true or remove engine.megatron_recompute",
    )


# What the Megatron engine cannot run: (recipe key, refused?, why and what to do instead)
def _megatron_refusals(recipe: Recipe) -> list[tuple[str, bool, str]]:
    e, m = recipe.engine, recipe.model
    return [
        ("engine.zero_stage", e.zero_stage != 0, "ZeRO stages are DeepSpeed's; Megatron's counterpart of ZeRO-1 "
         "is engine.distributed_optimizer; set engine.zero_stage=0"),
        ("engine.offload", e.offload != "none", "ZeRO-Offload is DeepSpeed's; set engine.offload=none"),
        ("task.kind", recipe.task.kind != "pretrain", f"{recipe.task.kind} (peft adapters, bitsandbytes 4-bit) "
         "wraps the Hugging Face model, not Megatron's GPTModel; set task.kind=pretrain or engine.kind=deepspeed"),
        ("optimizer.state_bits", recipe.optimizer.state_bits != 32, "Megatron runs its own Adam with fp32 "
         "states; set optimizer.state_bits=32"),
        ("engine.pipeline_stages", e.pipeline_stages != 1, "is the torch engine's pipeline; Megatron's is "
         "engine.pipeline_parallel; set engine.pipeline_stages=1"),
        ("model.attention", m.attention == "flash2", "flash2 is the flash-attn package under transformers; "
         "Megatron's sdpa runs torch SDPA, whose CUDA flash backend is FlashAttention-2; use model.attention=sdpa"),
        ("model.checkpoint", m.checkpoint is not None, "a Hugging Face checkpoint does not load into Megatron's "
         "GPTModel (it needs a weight conversion); remove model.checkpoint for random init"),
        ("model.compile", m.compile, "compiles the Hugging Face model's decoder layers; trainprof does not "
         "compile Megatron's GPTModel; set model.compile=false"),
        ("deepspeed", bool(recipe.deepspeed), "the deepspeed section is only read by engine.kind deepspeed; remove it"),
    ]


def _validate_megatron_combination(recipe: Recipe) -> None:
    """engine.kind megatron with a key only another engine or task supports: one line naming both keys."""
    for key, refused, why in _megatron_refusals(recipe):
        _require(not refused, f"recipe key '{key}' with engine.kind megatron: {why}")


def _validate_megatron_split(recipe: Recipe, shape: LlamaShape) -> None:
    """Tensor parallelism splits heads, key/value groups, the MLP width and the vocabulary across ranks;
    pipeline parallelism splits the decoder layers evenly (megatron-core's default layout)."""
    tp, pp = recipe.engine.tensor_parallel, recipe.engine.pipeline_parallel
    for dim in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        _require(
            getattr(shape, dim) % tp == 0,
            f"recipe key 'engine.tensor_parallel': {tp} does not divide model.{dim} ({getattr(shape, dim)}); "
            f"pick a tensor_parallel that divides it",
        )
    _require(
        shape.num_layers % pp == 0,
        f"recipe key 'engine.pipeline_parallel': {pp} does not divide model.num_layers ({shape.num_layers}); "
        "pick a pipeline_parallel that divides it",
    )


def check_world_size(recipe: Recipe, world_size: int) -> None:
    """Rules that need the number of ranks. Raises RecipeError."""
    _check_megatron_world_size(recipe, world_size)
    p = recipe.engine.pipeline_stages
    if p > 1:
        _require(
            world_size == p,
            f"recipe key 'engine.pipeline_stages': {p} stages need exactly {p} ranks (one stage per rank, no "
            f"data parallelism across pipelines), got {world_size}; run {p} ranks (trainprof run --nproc {p}, "
            f"torchrun --nproc_per_node {p}) or set engine.pipeline_stages={world_size}",
        )


def _check_megatron_world_size(recipe: Recipe, world_size: int) -> None:
    """Megatron's ranks form data-parallel replicas of tensor_parallel x pipeline_parallel ranks each."""
    e = recipe.engine
    if e.kind != "megatron":
        return
    per_replica = e.tensor_parallel * e.pipeline_parallel
    _require(
        world_size % per_replica == 0,
        f"recipe key 'engine.tensor_parallel': tensor_parallel x pipeline_parallel = {per_replica} ranks per model "
        f"replica does not divide the {world_size} ranks; run a multiple of {per_replica} ranks or lower "
        "engine.tensor_parallel / engine.pipeline_parallel",
    )


# ZeRO stages under which bitsandbytes 4-bit base weights train with LoRA: stage 3 would partition
# the packed 4-bit tensors, which DeepSpeed cannot gather back into Params4bit on these versions.
QLORA_ZERO_STAGES = frozenset({0, 1, 2})


# ---------------------------------------------------------------------------------------------
# Validation: rules that depend on this machine (the runner calls these, plan does not)
# ---------------------------------------------------------------------------------------------


def check_environment(recipe: Recipe, *, cuda_available: bool) -> None:
    """Rules that need the machine: CUDA, installed packages, a writable output dir. Raises RecipeError."""
    from trainprof.layout import output_dir_problem

    problem = output_dir_problem(recipe.output.dir)
    if problem is not None:  # found before training, not when the finished run is written
        raise RecipeError(f"recipe key 'output.dir': cannot write run dirs to '{recipe.output.dir}': {problem}; "
                          "pass output.dir=<a writable directory>")
    _check_megatron_environment(recipe, cuda_available=cuda_available)
    m = recipe.model
    if m.attention == "flash2":
        _require(
            cuda_available,
            "recipe key 'model.attention': flash2 needs a CUDA GPU; use model.attention=sdpa "
            "(PyTorch SDPA has a flash kernel on CPU and GPU)",
        )
        _require(
            importlib.util.find_spec("flash_attn") is not None,
            "recipe key 'model.attention': flash2 needs the flash-attn package; pip install flash-attn "
            "or use model.attention=sdpa",
        )
    if m.dtype == "fp16" and not cuda_available:
        raise RecipeError(
            "recipe key 'model.dtype': fp16 training needs a CUDA GPU (no fp16 loss scaling on CPU); "
            "use model.dtype=bf16 or fp32"
        )
    if recipe.task.kind == "qlora":
        _require(
            importlib.util.find_spec("bitsandbytes") is not None,
            "recipe key 'task.kind': qlora needs bitsandbytes; pip install bitsandbytes",
        )
    if recipe.optimizer.state_bits != 32:
        _require(
            importlib.util.find_spec("torchao") is not None,
            f"recipe key 'optimizer.state_bits': {recipe.optimizer.state_bits}-bit optimizer states need torchao; "
            "pip install torchao",
        )
    if recipe.task.kind in ("lora", "qlora"):
        _require(
            importlib.util.find_spec("peft") is not None,
            f"recipe key 'task.kind': {recipe.task.kind} needs peft; pip install peft",
        )
    if recipe.engine.kind == "deepspeed":
        _require(
            importlib.util.find_spec("deepspeed") is not None,
            "recipe key 'engine.kind': deepspeed is not installed; pip install deepspeed or set engine.kind=torch",
        )


def _check_megatron_environment(recipe: Recipe, *, cuda_available: bool) -> None:
    """megatron-core trains on CUDA only: its rotary embedding, RNG tracker and gradient buffers call
    torch.cuda unconditionally (`trainprof plan` still plans a Megatron recipe anywhere)."""
    if recipe.engine.kind != "megatron":
        return
    _require(
        cuda_available,
        "recipe key 'engine.kind': megatron trains on a CUDA GPU only (megatron-core calls torch.cuda in its "
        "rotary embedding and gradient buffers); run it on a GPU machine, or `trainprof plan` it here",
    )
    _require(
        importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None,
        "recipe key 'engine.kind': megatron needs megatron-core; pip install 'trainprof[megatron]' "
        "(megatron-core==0.16.1) or set engine.kind=deepspeed",
    )
