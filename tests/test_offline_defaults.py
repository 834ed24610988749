"""The offline API's defaults are vLLM's (issue 36 item 6): ``SamplingParams()``
samples at temperature 1, ``LLM.generate`` without params takes the checkpoint's
``generation_config.json`` over that, and ``detokenize=False`` returns ids only."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import shipped_llm

from adaserve import LLM, SamplingParams
from adaserve.errors import InvalidRequestError


def test_sampling_params_default_to_vllms():
    sp = SamplingParams()
    assert sp.temperature == 1.0 and not sp.greedy
    assert (sp.top_p, sp.top_k, sp.max_tokens, sp.n) == (1.0, 0, 16, 1)
    assert sp.detokenize is True


@pytest.fixture(scope="module")
def greedy_config_pair(tiny_pair, tmp_path_factory):
    """The tiny target with a generation_config.json that asks for greedy decoding and
    6 new tokens."""
    target, _, _ = tiny_pair
    d = tmp_path_factory.mktemp("gencfg") / "target"
    shutil.copytree(target, d)
    (d / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 6, "do_sample": False})
    )
    return d


def test_generate_without_params_takes_the_generation_config(greedy_config_pair, profile_file):
    llm = LLM(model=str(greedy_config_pair), no_draft=True, policy="ar", profile=profile_file)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.max_tokens) == (0.0, 6)
    prompts = [[3, 4, 5], [9, 8, 7, 6]]
    plain = llm.generate(prompts, use_tqdm=False)
    explicit = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in explicit]
    assert all(len(o.outputs[0].token_ids) <= 6 for o in plain)
    # generation_config="vllm": none of the file's values
    bare = LLM(
        model=str(greedy_config_pair),
        no_draft=True,
        policy="ar",
        profile=profile_file,
        generation_config="vllm",
    )
    assert bare.get_default_sampling_params() == SamplingParams()


def test_generate_without_params_samples_like_vllm(tiny_pair, profile_file):
    """No generation_config.json: the defaults are SamplingParams(), i.e. sampled at
    temperature 1, so two unseeded runs of one prompt differ somewhere."""
    target, _, _ = tiny_pair
    llm = LLM(model=str(target), no_draft=True, policy="ar", profile=profile_file)
    assert llm.get_default_sampling_params().temperature == 1.0
    outs = llm.generate([[5, 6, 7]] * 8, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_detokenize_false_returns_ids_only(profile_file):
    shipped = shipped_llm(profile_file)
    sp = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    with_text = shipped.generate("def f(x):", SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    ids_only = shipped.generate(
        "def f(x):", SamplingParams(**sp, detokenize=False), use_tqdm=False
    )[0].outputs[0]
    assert with_text.text and ids_only.text == ""
    assert ids_only.token_ids == with_text.token_ids
    assert all(p[t].decoded_token is None for p, t in zip(ids_only.logprobs, ids_only.token_ids))
    with pytest.raises(InvalidRequestError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["\n"])
