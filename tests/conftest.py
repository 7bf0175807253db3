"""Without CUDA the Triton kernels run in the interpreter, which must be chosen before triton reads
its settings: set here, before any test module or other conftest imports the engine (importing
inductor reads them; a kernels-only conftest was too late when another test folder ran first). CI
exports TRITON_INTERPRET=1 itself. The CPU ISA switch is applied here for the same reason."""

import gc
import os

import pytest

from kernels.cpu import isa as cpu_isa

cpu_isa.apply()  # COMPILED_ENGINE_CPU_ISA, before torch first dispatches (see kernels/cpu/isa.py)
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: E402

# inductor's graph cache does not key on the ISA cap: a graph that the tests compiled at the native
# level and then reused at `avx2` gave wrong results (test_ops_inside_torch_compile; not explained
# yet). So each capped level gets its own folder. (The engine's compile cache keys its entries by
# level itself.)
if cpu_isa.level() != "native":
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"isa-{cpu_isa.level()}")


@pytest.fixture(autouse=True)
def _engines_collectable_after_each_test():
    """`startup.build_engine` freezes everything that exists out of the cyclic GC (a serving process
    has one engine); tests build many in one process, so each test gives its objects back
    afterwards."""
    yield
    gc.unfreeze()
