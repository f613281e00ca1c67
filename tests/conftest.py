"""Test session set-up: CPU only, 4 virtual devices, float32 matmuls at full precision, shared fixtures."""

import os
import sys

# Before jax is imported anywhere: 4 virtual CPU devices for the mesh tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(__file__))  # tests/hf_models.py and friends
# No serialized executables from the user's store: a loaded executable skips tracing, so a test that
# patches model code would run what an earlier run stored (tests of the store turn it on themselves).
os.environ.setdefault("JAXSERVE_EXECUTABLE_STORE", "0")
os.environ.setdefault("JAXSERVE_WEIGHTS_CACHE", "0")  # likewise GGUF weights converted by an earlier run

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Free each module's compiled executables when it ends.

    XLA:CPU maps every executable's JIT-compiled code into memory, several mappings per kernel; a
    whole suite's worth alive in one process passes the kernel's limit of memory mappings
    (vm.max_map_count, 65530 by default), after which LLVM fails with "Cannot allocate memory" and
    the process aborts. Modules share nothing compiled, so dropping JAX's caches between them is free."""
    yield
    import gc

    gc.collect()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """Factory: path of a tiny random HF model of an architecture (built once per session)."""
    from hf_models import make_hf_model

    made: dict[tuple, tuple[str, object]] = {}

    def get(arch: str = "llama", dtype: str = "float32", **overrides):
        key = (arch, dtype, tuple(sorted(overrides.items())))
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"hf-{arch}-{dtype}"))
            made[key] = (path, make_hf_model(path, arch, dtype=dtype, **overrides))
        return made[key]

    return get
