"""The sampling-field table (jaxserve.sampling.fields) is the one description: SamplingParams, the API
schema, the server's translation, generation_config and SamplingTensors all agree with it."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.config import generation_config
from jaxserve.errors import ConfigError, RequestError
from jaxserve.model.sampler import ROW_SCALARS, RowSampling, SamplingTensors
from jaxserve.sampling.fields import BESPOKE, BY_NAME, DEVICE_FIELDS, FIELDS
from jaxserve.sampling.params import SamplingParams
from jaxserve.server import protocol, requests

NUMERIC = [f for f in FIELDS if f.type is not bool]


def test_every_sampling_params_field_is_in_the_table():
    # A field added to SamplingParams needs a table entry (or a place in BESPOKE, with its own checks).
    params = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert set(params) == set(BY_NAME) | set(BESPOKE)
    assert not set(BY_NAME) & set(BESPOKE)
    for field in FIELDS:
        assert params[field.name].default == field.default, field.name
        assert field.type.__name__ in str(params[field.name].type), field.name


def test_table_defaults_are_valid_and_shown_as_the_default():
    SamplingParams(**{f.name: f.default for f in FIELDS})
    for field in FIELDS:
        assert field.valid(field.default)


def _outside(field):
    """Values just outside the field's bounds (and, for ints, values of the wrong type)."""
    step = 1 if field.type is int else 0.5
    values = []
    if field.ge is not None:
        values.append(field.ge - step)
    if field.gt is not None:
        values.append(field.gt)
    if field.le is not None:
        values.append(field.le + step)
    if field.lt is not None:
        values.append(field.lt)
    if field.type is int:
        values += [True, 1.5]
    else:
        values.append(float("nan"))
    return values


@pytest.mark.parametrize("field", NUMERIC, ids=lambda f: f.name)
def test_sampling_params_refuses_out_of_range_values_naming_the_field(field):
    for value in _outside(field):
        with pytest.raises(RequestError, match=rf"^{field.name} must be .*, got {value!r}"):
            SamplingParams(**{field.name: value})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"top_k": -5}, "top_k must be 0 or -1 (no limit) or a positive integer, got -5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"seed": 2**32}, "seed must be in [0, 2**32), got 4294967296"),
        ({"n": 0}, "n must be an integer >= 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0, got -1"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"logprobs": 21}, "logprobs must be an integer in [0, 20], got 21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be an integer in [0, 20], got -1"),
    ],
)
def test_messages_are_those_of_before_the_table(kwargs, message):
    with pytest.raises(RequestError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_top_k_minus_one_means_no_limit():
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("model", [protocol.CompletionRequest, protocol.ChatCompletionRequest])
def test_request_schema_states_the_table(model):
    props = model.model_json_schema()["properties"]
    for field in FIELDS:
        if not field.request:
            continue
        assert model.model_fields[field.name].default is None, field.name  # absent: the model's default applies
        (typed, _null) = props[field.name]["anyOf"]
        assert typed["type"] == {int: "integer", float: "number", bool: "boolean"}[field.type], field.name
        assert typed.get("minimum") == field.ge and typed.get("exclusiveMinimum") == field.gt, field.name
        le = field.api_le if field.api_le is not None else field.le
        assert typed.get("maximum") == le and typed.get("exclusiveMaximum") == field.lt, field.name
        assert props[field.name]["description"] == field.api_description()


def test_api_bounds_are_validation_errors_and_params_bounds_are_request_errors():
    with pytest.raises(Exception) as err:  # pydantic's ValidationError: the server answers 400
        protocol.CompletionRequest(prompt="x", temperature=2.5)
    assert "temperature" in str(err.value)
    SamplingParams(temperature=2.5)  # the offline API takes what only the HTTP API limits
    protocol.CompletionRequest(prompt="x", top_k=-1, seed=2**32 - 1, n=protocol.MAX_N)


def test_server_hands_the_table_request_fields_to_sampling_params():
    table = {f.name for f in FIELDS if f.request}
    assert set(requests._SAMPLING_FIELDS) == table | {"logit_bias"}
    body = protocol.CompletionRequest(
        prompt="x",
        temperature=0.5,
        top_k=3,
        presence_penalty=1.0,
        ignore_eos=True,
        prompt_logprobs=2,
        logit_bias={"7": 1.0},
    )
    params = SamplingParams(**requests._sampling_values(body))
    assert (
        params.temperature,
        params.top_k,
        params.presence_penalty,
        params.ignore_eos,
        params.prompt_logprobs,
        params.logit_bias,
    ) == (0.5, 3, 1.0, True, 2, {7: 1.0})


def test_generation_config_reads_the_table_config_keys():
    expected = {f.config_key: f.name for f in FIELDS if f.config_key}
    assert generation_config.SAMPLING_KEYS == expected
    assert generation_config.SAMPLING_KEYS["max_new_tokens"] == "max_tokens"
    for key, name in expected.items():
        field = BY_NAME[name]
        for value in _outside(field):
            if isinstance(value, bool) or value == 1.5:
                continue  # a type error, not a range error
            with pytest.raises(ConfigError, match="out of range"):
                generation_config.parse_override({key: value})
    assert generation_config.parse_override({"top_k": 20.0, "temperature": 0}) == '{"temperature": 0.0, "top_k": 20}'


def test_sampling_tensors_carry_the_table_device_fields():
    tensor_fields = [f.name for f in dataclasses.fields(SamplingTensors)]
    assert set(tensor_fields) == set(ROW_SCALARS) | {"history", "bias_ids", "bias_values"}
    row_fields = {f.name: f for f in dataclasses.fields(RowSampling)}
    for field in DEVICE_FIELDS:
        assert row_fields[field.name].default == field.device.idle, field.name  # a padding row is idle
        assert ROW_SCALARS[field.name] == (field.device.dtype, field.device.idle)
    packed = SamplingTensors.pack(
        [
            RowSampling.from_params(
                SamplingParams(temperature=0.5, top_k=7, min_p=0.1, frequency_penalty=0.5), seed=3, step=2
            )
        ],
        (2,),
    )
    spec = SamplingTensors.spec((2,), 1)
    for name, (dtype, idle) in ROW_SCALARS.items():
        array = getattr(packed, name)
        assert array.dtype == np.dtype(dtype) == getattr(spec, name).dtype and array.shape == (2,), name
        assert array[1] == idle, name  # the padding row
    assert (packed.temperature[0], packed.top_k[0], packed.seed[0], packed.step[0]) == (0.5, 7, 3, 2)
    np.testing.assert_allclose([packed.min_p[0], packed.frequency_penalty[0]], [0.1, 0.5])


def test_server_path_imports_no_jax():
    code = (
        "import sys, jaxserve.sampling.fields, jaxserve.sampling.params, jaxserve.server.protocol, "
        "jaxserve.server.requests, jaxserve.config.generation_config; "
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m and 'jaxserve' not in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
