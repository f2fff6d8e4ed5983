"""SamplingParams validation names the field; defaults follow vLLM."""

import pytest

from mk.engine.sampling import SamplingError, SamplingParams


def test_defaults_and_greedy():
    p = SamplingParams()
    assert p.max_tokens == 16 and p.temperature == 1.0 and not p.greedy
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5, top_k=2).greedy and not SamplingParams(top_k=-1).greedy
    assert SamplingParams(stop="END").stop == ["END"]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"n": 0}, "n"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    assert str(e.value).startswith(field)
