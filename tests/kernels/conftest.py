"""Kernel-test fixtures: keep the TPU interpreter's global state clean between tests."""

import pytest
from jax.experimental.pallas import tpu as pltpu


@pytest.fixture(autouse=True)
def _reset_tpu_interpreter():
    # After an exception inside an interpreted TPU kernel the simulator's shared
    # state must be reset, or every later TPU-interpret test fails too.
    yield
    pltpu.reset_tpu_interpret_mode_state()
