"""Speculative decoding is exact: in deterministic mode every request's tokens and log-probabilities
with drafts (n-gram lookup, or a draft model: the checkpoint itself, which ignores the requests'
sampling rules) equal those it gets without speculation, greedy and seeded, with penalties,
min_tokens, stop ids, logit bias and structured output, under a tiny pool that retracts and evicts,
overlap on, compiled and eager (bf16, random-weight checkpoint). The ledger's integrity holds after
every step and no page leaks."""

from __future__ import annotations

import collections
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_engine.config import EngineConfig
from compiled_engine.sampling_params import SamplingParams, StructuredOutput
from compiled_engine.startup import build_engine

pytestmark = pytest.mark.slow

MAX_STEPS = 3000
REACHED: collections.Counter = collections.Counter()
SCHEMA = {"type": "object", "required": ["tags"],
          "properties": {"tags": {"type": "array", "items": {"enum": ["ab", "c"]}}}}


def _engine(demo_dir: str, spec: dict | None, **kw):
    # the settings of test_deterministic.py's engines: the same compiled graphs (compile cache)
    return build_engine(EngineConfig(model=demo_dir, dtype="bfloat16", buckets=[1, 4],
                                     max_running=16, deterministic=True, speculative=spec, **kw))


TIGHT = dict(num_pages=28, page_size=4, chunk_budget=8, overlap=True)


@pytest.fixture(scope="module")
def engines(demo_dir):
    """Without speculation (room for everything, no overlap: the reference) and with it (a pool
    that retracts and evicts, overlap on), compiled and eager."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "min_acceptance": 0.0, "disable_by_batch_size": 16}
    draft = {"method": "draft_model", "model": demo_dir, "num_speculative_tokens": 3,
             "disable_by_batch_size": 16}
    made = {
        "compiled": _engine(demo_dir, None, num_pages=4096, chunk_budget=8192),
        "compiled+ngram": _engine(demo_dir, spec, **TIGHT),
        "compiled+draft": _engine(demo_dir, draft, **TIGHT),
        "eager": _engine(demo_dir, None, num_pages=4096, chunk_budget=8192, enforce_eager=True),
        "eager+ngram": _engine(demo_dir, dict(spec, num_speculative_tokens=2,
                                              min_acceptance=0.5, acceptance_window=4,
                                              retry_after=2), **TIGHT, enforce_eager=True),
        "eager+draft": _engine(demo_dir, dict(draft, num_speculative_tokens=2), **TIGHT,
                               enforce_eager=True),
    }
    yield made
    for engine in made.values():
        engine.shutdown()


def _run(engine, requests: list[tuple[str, list[int], SamplingParams]], check: bool) -> dict:
    """All requests at once, stepped until done: each one's (tokens, logprobs, top logprobs,
    finish reason); `check`: the ledger's integrity after every step."""
    out: dict[str, list] = {rid: [[], [], [], None] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            break
        for ev in engine.step():
            if ev.token is not None:
                out[ev.rid][0].append(ev.token)
                out[ev.rid][1].append(ev.logprob)
                out[ev.rid][2].append(repr(ev.top_logprobs))
            if ev.finished:
                out[ev.rid][3] = ev.finish_reason
        if check:
            engine.scheduler.check_integrity()
    assert not engine.has_work(), "the engine did not finish"
    return {rid: tuple(map(lambda v: tuple(v) if isinstance(v, list) else v, r))
            for rid, r in out.items()}


def _request(rng: random.Random, planted: int, kind: str) -> tuple[list[int], SamplingParams]:
    """Noise with a segment planted twice, the second copy cut short: prompt lookup proposes the
    rest of it. A random-weight model does not copy by itself: most requests get a `logit_bias`
    towards the segment's tokens, so that their outputs repeat and drafts are accepted (greedy) or
    accepted now and then (sampled)."""
    seg = [rng.randrange(3, 7990) for _ in range(planted)]
    noise = [rng.randrange(3, 7990) for _ in range(rng.randrange(0, 12))]
    prompt = [1, *noise, *seg, *[rng.randrange(3, 7990) for _ in range(3)], *seg[: planted // 2]]
    bias = {t: rng.choice([4.0, 8.0]) for t in seg} if rng.random() < 0.7 else None
    return prompt, _params(rng, kind, bias)


def _params(rng: random.Random, kind: str, bias: dict[int, float] | None) -> SamplingParams:
    common = dict(max_tokens=rng.randrange(1, 25), ignore_eos=rng.random() < 0.7,
                  logprobs=rng.choice([None, 0, 2]), logit_bias=bias)
    if kind == "greedy":
        return SamplingParams(temperature=0.0, **common)
    if kind == "seeded":
        return SamplingParams(temperature=0.9, top_p=0.95, seed=rng.randrange(1 << 20), **common)
    if kind == "penalized":
        return SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                              min_tokens=min(3, common["max_tokens"]), stop_token_ids=(7, 8),
                              **common)
    return SamplingParams(temperature=0.0, structured=StructuredOutput("json", json.dumps(SCHEMA)),
                          **dict(common, max_tokens=40, logit_bias=None))


@settings(max_examples=32, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    planted=st.lists(st.integers(2, 16), min_size=1, max_size=6),
    kinds=st.lists(st.sampled_from(["greedy", "seeded", "penalized", "structured"]), min_size=6,
                   max_size=6),
    path=st.sampled_from(["compiled", "eager"]),
    method=st.sampled_from(["ngram", "draft"]),
    seed=st.integers(0, 2**16),
)
def test_speculation_gives_the_tokens_and_logprobs_of_plain_decoding(
    engines, planted, kinds, path, method, seed
):
    rng = random.Random(seed)
    requests = [(f"r{i}", *_request(rng, n, kinds[i])) for i, n in enumerate(planted)]
    spec_engine = engines[f"{path}+{method}"]
    sched = spec_engine.scheduler
    before = (sched.spec.num_draft_tokens, sched.spec.num_accepted_tokens, sched.num_retractions)
    plain = _run(engines[path], requests, check=False)
    assert _run(spec_engine, requests, check=True) == plain
    drafted = sched.spec.num_draft_tokens - before[0]
    accepted = sched.spec.num_accepted_tokens - before[1]
    REACHED["accepted"] += accepted > 0
    REACHED["rejected"] += drafted > accepted
    REACHED["retracted"] += sched.num_retractions > before[2]
    REACHED["examples"] += 1


def test_the_property_accepted_rejected_and_retracted():
    """The examples above (same module, run just before) accepted and rejected drafts, and
    retracted a request at least once."""
    if not REACHED["examples"]:
        pytest.skip("the property test did not run in this session")
    print("speculation property:", dict(REACHED))
    assert REACHED["accepted"] and REACHED["rejected"] and REACHED["retracted"], REACHED


@pytest.mark.parametrize("name", ["compiled+ngram", "compiled+draft", "eager+ngram", "eager+draft"])
def test_each_engine_accepts_and_rejects_and_stays_exact(engines, name):
    """Every speculative engine, on requests made to accept (greedy: biased towards a planted
    segment for n-gram lookup, plain for the draft model, which is the checkpoint itself) and to
    reject (sampled)."""
    rng = random.Random(7)
    prompt, biased = _request(rng, 8, "greedy")
    biased = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1,
                            logit_bias=biased.logit_bias or {t: 8.0 for t in prompt[1:9]})
    requests = [("biased", prompt, biased),
                ("plain", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
                ("sampled", prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=3,
                                                   ignore_eos=True, logit_bias=biased.logit_bias))]
    sched = engines[name].scheduler
    before = sched.spec.num_draft_tokens, sched.spec.num_accepted_tokens
    got = _run(engines[name], requests, check=True)
    assert got == _run(engines[name.split("+")[0]], requests, check=False)
    drafted = sched.spec.num_draft_tokens - before[0]
    accepted = sched.spec.num_accepted_tokens - before[1]
    assert 0 < accepted < drafted, (accepted, drafted)
    assert REACHED["retracted"], REACHED


def test_where_deterministic_defaults_off_speculation_turns_it_on(engines, demo_dir, monkeypatch):
    """On a device whose deterministic default is off but has a fast batch-invariant path (an AMX
    CPU, CUDA: this CPU's row is made so), an engine with drafts and no --deterministic /
    --no-deterministic runs the batch-invariant kernels all the same: its verify rows and decode
    rows get the same bits, and every request's tokens equal plain deterministic decoding's. Where
    the invariant path is one row at a time (`cpu-portable`), it stays off."""
    import torch

    from compiled_engine.runner import device_defaults as defaults

    kind = defaults.device_kind(torch.device("cpu"))
    monkeypatch.setitem(defaults.DETERMINISTIC_BY_DEVICE, kind,
                        defaults.DeviceDefault(False, "off here"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "min_acceptance": 0.0}
    engine = build_engine(EngineConfig(model=demo_dir, dtype="bfloat16", buckets=[1, 4],
                                       max_running=16, speculative=spec, enforce_eager=True,
                                       **TIGHT))
    plain_off = build_engine(EngineConfig(model=demo_dir, dtype="bfloat16", max_running=16,
                                          enforce_eager=True, num_pages=256))
    try:
        assert engine.config.deterministic and not plain_off.config.deterministic
        rng = random.Random(7)
        requests = [(f"r{i}", *_request(rng, n, kind))
                    for i, (n, kind) in enumerate([(8, "greedy"), (12, "seeded"), (6, "greedy")])]
        before = engine.scheduler.spec.num_accepted_tokens
        assert _run(engine, requests, check=True) == _run(engines["eager"], requests, check=False)
        assert engine.scheduler.spec.num_accepted_tokens > before
    finally:
        engine.shutdown()
        plain_off.shutdown()
    monkeypatch.setitem(defaults.DETERMINISTIC_BY_DEVICE, kind,
                        defaults.DeviceDefault(False, "slow here", with_speculation=False))
    assert defaults.deterministic_default(torch.device("cpu"), speculative=True)[0] is False
