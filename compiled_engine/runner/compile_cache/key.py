"""The compile-cache key: every input that changes the code torch.compile generates, and nothing
else."""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

import compiled_engine
from compiled_engine.config import EngineConfig
from compiled_engine.parallel import parallel_state as ps
from compiled_engine.runner.model_runner import RunnerConfig
from kernels import ops
from kernels.packed import PackedWeight

# Code that dynamo traces or inductor calls into (the attention kernels live in `kernels`), less the
# files it never reaches, so that editing a benchmark or the sampler keeps the cache.
_PACKAGE_ROOT = Path(compiled_engine.__file__).resolve().parent
TRACED_SOURCES: tuple[Path, ...] = (
    *(_PACKAGE_ROOT / name for name in ("models", "layers", "runner")),
    Path(ps.__file__).resolve(),  # the ordered all-reduce that TP graphs trace
    _PACKAGE_ROOT.parent / "kernels",
)
UNTRACED = frozenset(
    {
        "bench.py",
        "reference.py",
        "loader.py",
        "gguf_checkpoint.py",
        "errors.py",
        "weight_utils.py",
        "sampler.py",
        "buckets.py",
    }
)
# Source files by suffix: Python, and native code built into the kernels (e.g. kernels/*.cpp).
SOURCE_SUFFIXES = frozenset({".py", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh"})


@dataclass(frozen=True)
class CacheKey:
    model_config: str  # sha256 of the model's config
    dtype: str
    # cpu | cuda:<capability>, with the CPU ISA (and the COMPILED_ENGINE_CPU_ISA level) or GPU name
    device: str
    tp_size: int
    tp_rank: int
    buckets: tuple[int, ...]
    max_running: int
    max_context: int
    page_size: int
    # the KV tensors are graph inputs of static shape: dynamo specializes on their size
    num_pages: int
    # inductor options (freezing bypasses the FX graph cache: such starts always compile)
    compile_mode: str
    deterministic: bool  # the kernel ops' `invariant` argument, a constant of the graphs
    # which weights are packed, in which block format (the graphs call other ops for them)
    weight_layout: str
    torch: str
    triton: str
    python: str
    engine_source: str  # sha256 of the traced source files

    @property
    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:24]

    def fields(self) -> dict:
        return asdict(self)


def cache_key(
    config: EngineConfig,
    model_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    runner: RunnerConfig,
    model: torch.nn.Module,
) -> CacheKey:
    """The key of an engine about to compile, from its resolved settings (sizes, buckets, dtype);
    the rest of `config` (sampling, scheduling, overlap, seed) never reaches the graphs."""
    return CacheKey(
        model_config=model_config_hash(model_config),
        dtype=str(dtype).removeprefix("torch."),
        device=device_kind(device),
        tp_size=config.tp_size,
        tp_rank=ps.get_tp_rank(),
        buckets=tuple(sorted(runner.buckets)),
        max_running=runner.max_rows,
        max_context=runner.max_context,
        page_size=runner.page_size,
        num_pages=runner.num_pages,
        compile_mode=config.compile_mode,
        deterministic=runner.deterministic,
        weight_layout=weight_layout(model),
        torch=torch.__version__,
        triton=_triton_version(),
        python=platform.python_version(),
        engine_source=source_hash(TRACED_SOURCES),
    )


def weight_layout(model: torch.nn.Module) -> str:
    """A hash of where the model holds packed weights and in which formats, and of its LoRA slots'
    shapes ("dense" for neither)."""
    packed = [f"{name}:{m.format.name}" for name, m in model.named_modules()
              if isinstance(m, PackedWeight)]
    packed += [f"{name}:lora{tuple(m.lora_a.shape)}{tuple(m.lora_b.shape)}"
               for name, m in model.named_modules() if getattr(m, "lora_a", None) is not None]
    if not packed:
        return "dense"
    return hashlib.sha256("\n".join(packed).encode()).hexdigest()[:16]


def model_config_hash(config: PretrainedConfig) -> str:
    """The model's config, less where it was read from and which transformers version wrote it."""
    fields = {
        k: v
        for k, v in config.to_dict().items()
        if k not in ("_name_or_path", "transformers_version")
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def source_hash(roots: tuple[Path, ...]) -> str:
    h = hashlib.sha256()
    for root in roots:
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            if path.name in UNTRACED or path.suffix not in SOURCE_SUFFIXES or not path.is_file():
                continue
            h.update(
                str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes() + b"\0"
            )
    return h.hexdigest()[:16]


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return (
            f"cuda:sm{major}{minor}:{torch.cuda.get_device_name(device)}:cuda{torch.version.cuda}"
        )
    # the COMPILED_ENGINE_CPU_ISA level too: ATen reports no AMX level, so `native` and `avx512`
    # read alike; and whether the native kernels serve (the portable LoRA delta is traced in)
    return (
        f"{device.type}:{torch.backends.cpu.get_cpu_capability()}:{platform.machine()}"
        f":isa-{ops.isa_level()}:native-{int(ops.native_loaded())}"
    )


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__
