"""Shared fixtures: tiny random models built with ``transformers`` and saved to disk."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

VOCAB = 320

# the tiny test models are overhead-bound: one intra-op thread avoids oversubscribing
# the cores when several processes (server subprocesses, pytest) run at once
torch.set_num_threads(1)


# the shape of the tiny draft beside the tiny target (shares its vocabulary)
TINY_DRAFT = dict(
    num_hidden_layers=1,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def save_tiny(path, arch: str = "llama", seed: int = 0, **overrides):
    """Build a tiny random HF model of ``arch`` and ``save_pretrained`` it to ``path``."""
    import transformers

    torch.manual_seed(seed)
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # wide init spreads the logits so that argmax near-ties (where float rounding
        # could flip a greedy choice) are vanishingly rare
        initializer_range=0.2,
        eos_token_id=VOCAB - 1,
        bos_token_id=None,
        pad_token_id=0,
    )
    base.update(overrides)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    cfg = cls[0](**base)
    model = cls[1](cfg).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session", autouse=True)
def _own_cache_folder(tmp_path_factory):
    """The suite's profiles, targets records and compiled kernels go to a folder of its
    own, never the user's ``~/.cache/adaserve`` (a module that wants an empty one sets
    ``ADASERVE_CACHE`` itself, as ``server_test_env`` does); so does the usage ledger's
    data folder (``ADASERVE_DATA``), never ``~/.local/share/adaserve``."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ADASERVE_CACHE", str(tmp_path_factory.mktemp("adaserve_cache_session")))
    mp.setenv("ADASERVE_DATA", str(tmp_path_factory.mktemp("adaserve_data_session")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir, hf_target): a 2-layer target and a 1-layer random draft."""
    root = tmp_path_factory.mktemp("pair")
    hf = save_tiny(root / "target", seed=0)
    save_tiny(root / "draft", seed=1, **TINY_DRAFT)
    return root / "target", root / "draft", hf


def replay_engine(eng, policy: str, requests, steps, cfg=None, num_blocks=None, **kw):
    """``sim.replay.replay`` of a recorded run of engine ``eng`` under a fresh
    ``policy``, with the engine's config, profile and pool (``cfg`` / ``num_blocks``
    to replay with others)."""
    from adaserve.policies.registry import make_policy
    from adaserve.sim.replay import replay

    return replay(
        cfg or eng.cfg,
        make_policy(policy),
        eng.hw,
        eng.allocator.num_blocks if num_blocks is None else num_blocks,
        eng.max_model_len,
        eng.unloaded_tpot_ms(),
        requests,
        steps,
        **kw,
    )


def with_tokens(requests, live: dict) -> list:
    """Recorded requests with the token ids of their live engine requests (``rid ->
    Request``), so a replay names KV blocks as the engine did."""
    import dataclasses

    return [
        dataclasses.replace(q, tokens=tuple(live[q.rid].tokens)) if q.rid in live else q
        for q in requests
    ]


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(torch.randint(1, VOCAB - 1, (L,), generator=g).tolist())
    return out


def ref_penalize(row: torch.Tensor, prompt, output, sp) -> torch.Tensor:
    """vLLM's penalties of one logits row [V] by their definition, token by token (the
    tests' reference): a token seen in the prompt or the output has its logit divided
    by ``repetition_penalty`` when positive, multiplied by it otherwise; then
    ``- frequency_penalty * count - presence_penalty * (count > 0)`` over the output."""
    if not sp.penalized:
        return row
    x = row.double().clone()
    output = [int(t) for t in output]
    for t in set(int(t) for t in prompt) | set(output):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(output):
        x[t] -= sp.frequency_penalty * output.count(t) + sp.presence_penalty
    return x.float()


# the 12-token pair of the distribution tests (tests/test_spec.py, test_structured.py)
SMALL_VOCAB = 12
SMALL_PAIR_KW = dict(
    vocab_size=SMALL_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    pad_token_id=None,
    initializer_range=0.2,
)


def save_small_pair(root, eos_token_id=None):
    """(target, draft) of the distribution tests under ``root`` (seeds 21 and 22)."""
    save_tiny(root / "t", seed=21, eos_token_id=eos_token_id, **SMALL_PAIR_KW)
    save_tiny(root / "d", seed=22, num_hidden_layers=1, eos_token_id=eos_token_id, **SMALL_PAIR_KW)
    return root / "t", root / "d"


def shipped_llm(profile: str, **kw):
    """The shipped pair offline, on a tick clock (the budgeted policies' decisions never
    follow machine speed), with the given hardware profile."""
    from adaserve import LLM
    from adaserve.core.clock import TickClock

    return LLM(profile=profile, clock=TickClock(0.001), kv_cache_bytes=64 << 20, **kw)


def fixed_generators(llm, n: int) -> None:
    """The next ``n`` unseeded requests of ``llm`` get generators seeded 0..n-1 (a
    sampling test that is reproducible)."""
    from adaserve.spec_decode.logits import make_generator

    runner = llm.engine.runner
    fixed = iter(range(n))
    runner.generator = lambda seed: make_generator(next(fixed), runner.device)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Chi-square goodness of fit of ``counts`` to ``probs``: (statistic, degrees of
    freedom, p-value by the Wilson-Hilferty approximation).

    Cells with expected count < 5 are pooled; a sample in a zero-probability cell
    gives p = 0 outright.
    """
    n = counts.sum()
    exp = probs * n
    if (counts[probs == 0] > 0).any():
        return math.inf, 0, 0.0
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    keep = ex > 0
    stat = float(((obs[keep] - ex[keep]) ** 2 / ex[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 10, "the test distribution is too concentrated to tell samplers apart"
    v = 2 / (9 * df)
    z = ((stat / df) ** (1 / 3) - (1 - v)) / math.sqrt(v)
    return stat, df, 0.5 * math.erfc(z / math.sqrt(2))


def chi_square_rejects(counts: np.ndarray, probs: np.ndarray, alpha_z: float = 3.09) -> bool:
    """The chi-square test at alpha = 0.001 (z = 3.09: Wilson-Hilferty critical value)."""
    stat, df, _ = chi_square(counts, probs)
    if df == 0:
        return True
    crit = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat > crit


@pytest.fixture(scope="module")
def cheap_profile(tmp_path_factory):
    """A reduced hardware profile (verification cost flat to 16 tokens, a cheap draft),
    so that no test spends time profiling."""
    p = tmp_path_factory.mktemp("prof") / "p.json"
    p.write_text(
        json.dumps(
            {
                "verify": {"tokens": [1, 16, 64, 256], "latency_ms": [10.0, 12.0, 20.0, 60.0]},
                "draft_step_ms": 0.5,
            }
        )
    )
    return str(p)


# a profile in which speculation pays (cheap draft, flat verification) so that the
# adaptive policies really build trees on the tiny models
CHEAP_DRAFT_PROFILE = {
    "verify": {"tokens": [1, 64, 256, 1024], "latency_ms": [10.0, 11.0, 14.0, 30.0]},
    "draft_step_ms": 0.2,
}


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    """``CHEAP_DRAFT_PROFILE`` as a profile file."""
    p = tmp_path_factory.mktemp("prof") / "profile.json"
    p.write_text(json.dumps(CHEAP_DRAFT_PROFILE))
    return str(p)


# ---------------------------------------------------------------------- the browser


def _chromium():
    """(chromium, chromedriver) paths, or a skip that says what is missing."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip(
            "headless Chromium is missing: apt-get install -y chromium chromium-driver "
            "(.ci/run installs them)"
        )
    return browser, driver


@pytest.fixture
def browser():
    path, driver_path = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = path
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(a)
    opts.add_argument("--window-size=1440,2200")
    d = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    d.set_page_load_timeout(60)
    yield d
    d.quit()


# The modules whose tests take about 8 s or more in all (``pytest --durations=0`` on the
# development machine: 21 modules, 770 of the suite's 880 s), and the server-level
# sampling, seeding and hardening modules that kept the lane over 2 minutes (2026-12-06:
# 2 min 11 s -> 1 min 48 s of tests). ``make test-fast`` leaves them out (the unit
# lane); ``make test`` runs everything.
SLOW_MODULES = frozenset(
    {
        "test_bench_run",
        "test_cli",
        "test_cli_flags",
        "test_cluster_exposure",
        "test_cluster_ray",
        "test_dashboard",
        "test_demo",
        "test_logit_bias",
        "test_offline_defaults",
        "test_overload_paced",
        "test_prefix_cache",
        "test_seeded",
        "test_server_big_inputs",
        "test_server_cli",
        "test_server_degrade",
        "test_server_hardening",
        "test_server_http_limits",
        "test_server_overload",
        "test_server_quota_first",
        "test_server_schemathesis",
        "test_server_structured",
        "test_server_timeouts",
        "test_server_usage_ledger",
        "test_spec",
        "test_structured",
        "test_train",
        "test_verify_batch",
        "test_vllm_sampling_fields",
    }
)


def pytest_collection_modifyitems(config, items):
    """Mark every test of ``SLOW_MODULES`` ``slow``."""
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
