"""Packed step inputs (jaxserve.model.transfer): every dtype comes back bit for bit, and inputs that do not
match the compiled layout are refused rather than misread."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.kv_cache import StepBatch
from jaxserve.model.sampler import RowSampling, SamplingTensors
from jaxserve.model.transfer import Layout, from_buffer


def inputs(R=2, B=3, T=4, P=5):
    rng = np.random.RandomState(0)
    batch = StepBatch(
        tokens=rng.randint(-(2**31), 2**31 - 1, size=(R, B, T)).astype(np.int32),
        start_pos=rng.randint(0, 100, size=(R, B)).astype(np.int32),
        num_new=np.ones((R, B), np.int32),
        page_table=rng.randint(0, 9, size=(R, B, P)).astype(np.int32),
    )
    rows = [
        RowSampling(
            temperature=0.7,
            top_k=5,
            top_p=0.9,
            min_p=0.05,
            seed=2**32 - 1,
            step=3,
            presence_penalty=-1.5,
            repetition_penalty=1.2,
            prompt_ids=[1, 2],
            output_ids=[3],
        )
    ] * (R * B - 1)
    sampling = SamplingTensors.pack(rows + [None], (R, B), history_len=8)
    flags = rng.rand(R, B) > 0.5
    return batch, sampling, flags


def test_unpacked_inputs_equal_the_host_inputs_bit_for_bit():
    host = inputs()
    layout = Layout.of(host)
    buffer = layout.pack(host)
    assert buffer.dtype == np.int32 and buffer.shape == (2, layout.width)
    back = jax.jit(layout.unpack)(jax.device_put(buffer))
    for want, got in zip(jax.tree.leaves(host), jax.tree.leaves(back)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)


def test_the_layout_of_shape_structs_packs_the_arrays_they_describe():
    host = inputs()
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)
    assert Layout.of(specs) == Layout.of(host)
    assert hash(Layout.of(specs)) == hash(Layout.of(host))  # a static argument of the compiled step


def test_inputs_that_do_not_match_the_layout_are_refused():
    batch, sampling, flags = inputs()
    layout = Layout.of((batch, sampling, flags))
    with pytest.raises(ValueError, match="do not match"):
        layout.pack((batch, sampling))
    with pytest.raises(ValueError, match="does not match"):
        layout.pack((batch.replace(page_table=np.zeros((2, 3, 6), np.int32)), sampling, flags))
    with pytest.raises(ValueError, match="does not match"):
        layout.pack((batch, sampling, flags.astype(np.int32)))
    with pytest.raises(TypeError, match="cannot pack"):
        Layout.of((np.zeros((2, 3), np.float64),))
    with pytest.raises(ValueError, match="leading replica axis"):
        Layout.of((np.zeros((2, 3), np.int32), np.zeros((3, 3), np.int32)))


def test_a_step_takes_its_inputs_from_one_buffer():
    def step(params, batch, sampling, flags):
        return params * batch.start_pos + jnp.where(flags, sampling.step, 0)

    host = inputs()
    layout = Layout.of(host)
    packed = jax.jit(from_buffer(step, 1), static_argnames="layout")
    got = packed(jnp.int32(2), jax.device_put(layout.pack(host)), layout=layout)
    np.testing.assert_array_equal(np.asarray(got), step(2, *host))
