"""Public API of pallas_kernels: exports, reference/kernel signature parity, backend selection."""

import importlib
import inspect

import pytest

from pallas_kernels._common import resolve_backend
from pallas_kernels.int4_matmul import int4_matmul, reference_int4_matmul
from pallas_kernels.int8_matmul import int8_matmul, reference_int8_matmul
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference_ragged_paged_attention

PAIRS = [
    (ragged_paged_attention, reference_ragged_paged_attention),
    (int8_matmul, reference_int8_matmul),
    (int4_matmul, reference_int4_matmul),
]


def test_top_level_exports():
    pk = importlib.import_module("pallas_kernels")
    assert pk.__file__ is not None, "pallas_kernels imported as a namespace package: reinstall with pip install -e ."
    for kernel, reference in PAIRS:
        assert getattr(pk, kernel.__name__) is kernel
        assert getattr(pk, reference.__name__) is reference


@pytest.mark.parametrize("kernel,reference", PAIRS)
def test_reference_has_the_kernel_signature(kernel, reference):
    ks, rs = inspect.signature(kernel), inspect.signature(reference)
    assert [(p.name, p.kind, p.default) for p in ks.parameters.values()] == [
        (p.name, p.kind, p.default) for p in rs.parameters.values()
    ]


def test_package_does_not_import_jaxserve():
    import sys

    import pallas_kernels.int4_matmul.gpu  # noqa: F401
    import pallas_kernels.int4_matmul.tpu  # noqa: F401
    import pallas_kernels.int8_matmul.tpu  # noqa: F401
    import pallas_kernels.ragged_paged_attention.gpu  # noqa: F401
    import pallas_kernels.ragged_paged_attention.tpu  # noqa: F401

    for name, mod in list(sys.modules.items()):
        if name.startswith("pallas_kernels") and getattr(mod, "__file__", None):
            assert "import jaxserve" not in open(mod.__file__).read()
            assert "from jaxserve" not in open(mod.__file__).read()


def test_resolve_backend():
    assert resolve_backend("tpu", True, fn_name="x") == "tpu"
    assert resolve_backend("gpu", False, fn_name="x") == "gpu"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("mosaic", True, fn_name="x")
