"""Host synchronisations per decode step, counted on this CPU (``testkit/drivers/sync_count.py`` says
how): outside decision steps a ``full`` step reads back only the sampled ids and a ``conf-kv`` one
also the step's positions (once, for every sequence's retention state), and under the precision
chain the step's sampling signal (once, ``core.step_signal``); a decision step waits once more, for
the whole step's attention signal (``retention.scoring.score_batch``). Step metadata is
sent through preallocated host buffers copied ``non_blocking`` (pinned on CUDA), so no step makes a
blocking send."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from confkv_api.config import ConfKVConfig
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.parts import build_parts
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from confkv_engine.retention import native_mass
from testkit.drivers.sync_count import SyncCounter
from tests.engine.tiny_models import make_tiny_hf_model

PROMPT, SEQS, STEPS = 40, 4, 40
POLICIES = {
    "full": {"kvPolicy": "full"},
    "full+static": {"kvPolicy": "full"},  # the static-buffer decode path (CUDA graphs on CUDA)
    "full+sampled": {"kvPolicy": "full"},  # temperature, top-k, top-p and a seed: the sampling inputs
    "conf-kv": {"kvPolicy": "conf-kv", "budget": 0.5, "tiers": ["full", "key_only"]},  # no codec work
    "conf-kv+tiers": {"kvPolicy": "conf-kv", "budget": 0.5, "tiers": ["full", "int4", "int2"]},
}


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[bool, SyncCounter]]]:
    """Per policy, for each decode step of SEQS sequences: (decision step?, its counter). The CPU's
    native fold of the attention signal (``native_mass``: it folds where it scores, so it has nothing
    to wait for) is off: the counts are those of the device path, which queues and waits once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_mass, "applies", lambda device: False)
        return _steps(tmp_path_factory)


def _steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[bool, SyncCounter]]]:
    _, model_dir = make_tiny_hf_model("llama", Path(tmp_path_factory.mktemp("sync")))
    loaded = load_model(str(model_dir))
    out = {}
    for name, confkv in POLICIES.items():
        config = ConfKVConfig.model_validate({"engine": {"prefillChunk": 64, "blockSize": 16},
                                              "confkv": {**confkv, "maxCacheSize": "8Mi"}})
        parts = build_parts(loaded, config, static_decode=name.endswith("static"))
        engine = LLMEngine(loaded, config, parts=parts)
        sampled = dict(temperature=0.8, top_k=20, top_p=0.9, seed=1) if name.endswith("sampled") else {}
        params = SamplingParams(**{"temperature": 0.0, **sampled}, max_tokens=STEPS + 2, ignore_eos=True)
        for i in range(SEQS):
            engine.add_request(f"r{i}", [5 + i] * PROMPT, params)
        # The prefill: one chunk, or several under a precision chain, which prefills a budgeted
        # sequence in chunks of its own (shorter) decision interval.
        for _ in range(PROMPT):
            if len(engine.step()) == SEQS:
                break
        interval, recorded = engine.retention.interval_for(engine.retention.defaults), []
        for k in range(STEPS):
            with SyncCounter() as counter:
                assert len(engine.step()) == SEQS
            # Step k computes position PROMPT + k: a decision when the length it reaches is a multiple.
            recorded.append(((PROMPT + k + 1) % interval == 0, counter))
        out[name] = recorded
    return out


def _kinds(events: list[tuple[str, str]]) -> Counter[tuple[str, str]]:
    return Counter((kind, where.split(":")[0]) for kind, where in events)


@pytest.mark.parametrize("policy", ["full", "full+sampled"])
def test_full_decode_step_reads_back_only_the_sampled_ids(steps, policy: str) -> None:
    for _, counter in steps[policy]:
        assert _kinds(counter.syncs()) == Counter({("tolist", "core/step_io.py"): 1})


def test_static_decode_step_reads_back_only_the_sampled_ids(steps) -> None:
    """The static-buffer path (every step of a ``full`` batch takes it). Its kernel here is the CPU
    one (``attention.kernels.cpu``), which plans its reads from the K and V tables it is given: those
    are CPU tensors read on the host, not waits, and that kernel never runs beside a GPU
    (``kernels.kernel_for`` picks Triton there, which reads nothing back); they are counted apart."""
    for _, counter in steps["full+static"]:
        kinds = _kinds(counter.syncs())
        assert kinds.pop(("tolist", "attention/kernels/cpu.py"), 0) == 2 * SEQS  # K and V tables
        assert kinds == Counter({("tolist", "core/step_io.py"): 1})


@pytest.mark.parametrize("policy,signal", [("conf-kv", 0), ("conf-kv+tiers", 1)])
def test_conf_kv_decode_step_outside_decisions_reads_back_at_most_three_times(steps, policy: str,
                                                                               signal: int) -> None:
    """The precision chain's confidence weighs the sampling signal: its step reads the step's values
    back once more, for every sequence together (``core.step_signal``)."""
    plain = [c for decision, c in steps[policy] if not decision]
    assert len(plain) >= STEPS - 3  # a precision chain decides every 16 tokens
    for counter in plain:
        expected = Counter({("tolist", "core/step_io.py"): 1, ("cpu", "attention/retention.py"): 1})
        if signal:
            expected[("tolist", "core/step_signal.py")] = signal
        assert _kinds(counter.syncs()) == expected


@pytest.mark.parametrize("policy,per_sequence,signal", [("conf-kv", 0, 0), ("conf-kv+tiers", 1, 1)])
def test_decision_step_read_backs(steps, policy: str, per_sequence: int, signal: int) -> None:
    """Recorded exactly: one wait for the whole step's attention signal (every sequence's and every
    layer's probabilities queued into host buffers first; it was one wait per sequence, and before
    that 2 read-backs per layer per sequence), precision tiers add one list per sequence, and the
    precision chain's sampling signal one for the step."""
    decisions = [c for decision, c in steps[policy] if decision]
    assert decisions
    for counter in decisions:
        kinds = _kinds(counter.syncs())
        assert kinds[("wait", "retention/scoring.py")] == 1
        assert kinds[("tolist", "core/step_signal.py")] == signal
        # The tiers' list comes with a budget walk; under the floor (early decisions) there is none.
        assert len(counter.syncs()) in (3 + signal, 3 + signal + per_sequence * SEQS)
    assert len(decisions[-1].syncs()) == 3 + signal + per_sequence * SEQS


def test_decision_step_reads_back_once(steps) -> None:
    for counter in [c for decision, c in steps["conf-kv"] if decision]:
        assert len(counter.syncs()) <= 3


def test_decode_step_sends_metadata_without_blocking_copies(steps) -> None:
    for _, counter in steps["full"]:
        assert counter.sends() == []


def test_no_blocking_sends_in_any_decode_step(steps) -> None:
    """Every policy, decision steps included: metadata goes through the cache's pinned staging
    (``cache.staging.HostStaging``), never ``torch.tensor(list, device=...)``."""
    sends = {name: sorted({(decision, len(c.sends())) for decision, c in recorded})
             for name, recorded in steps.items()}
    assert sends == {name: [(False, 0), (True, 0)] for name in POLICIES}, sends
