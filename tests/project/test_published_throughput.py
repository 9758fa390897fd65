"""The step-time model against published training throughput (issue 24): every run of tests/data/throughput.toml
(torchtitan's benchmarks, llm-foundry's MPT tables, Megatron-LM's 3D against ZeRO-3, fms-fsdp), each with its
source, quote and configuration, priced by `zeroplan estimate --gpu`. No constant of the model is fitted to these
rows (docs/throughput.md: where each comes from). The issue's targets: at least 70% of the runs within 20%, the
median |error| at most 12%, and the published rankings: 3D beats ZeRO-3 where it was measured to, interleaved 1F1B
beats 1F1B, an 8B model keeps at least 90% of its per-GPU throughput from 8 to 128 GPUs. Where a target is not met,
the test states today's figures (a floor they may not fall below) and the target stays as a strict expected
failure: meeting it fails that test, so that it is promoted."""

from __future__ import annotations

import pytest

from tests.throughput import MEDIAN_TARGET, SHARE_TARGET, distribution, price_all

# today's figures (docs/throughput.md): the floor the model may not fall below
SHARE_NOW = 0.65
MEDIAN_NOW = 0.175


@pytest.fixture(scope="module")
def priced():
    return {p.run["id"]: p for p in price_all()}


def test_every_published_run_has_its_source_quote_and_configuration_and_is_priced(priced):
    assert len(priced) >= 60
    for p in priced.values():
        assert p.run["source"] and p.run["quote"] and p.run["args"] and p.published > 0
        assert p.predicted > 0 and p.step["seconds"] == pytest.approx(sum(p.step["terms"].values()))


def test_the_errors_stay_where_they_are(priced):
    found = distribution(list(priced.values()))
    assert found.within >= SHARE_NOW and found.median_abs <= MEDIAN_NOW, found


@pytest.mark.xfail(strict=True, reason="issue 24's targets are not met: 65% of 66 runs within 20%, median |error| 17% "
                   "(docs/throughput.md says where the misses are)")
def test_issue_24s_error_targets(priced):
    found = distribution(list(priced.values()))
    assert found.within >= SHARE_TARGET and found.median_abs <= MEDIAN_TARGET, found


def _tokens(priced, run_id: str) -> float:
    return priced[run_id].predicted


def test_interleaved_1f1b_beats_1f1b_as_published(priced):
    # torchtitan Table 5: 405B on 512 H100s, 128 against 100 tokens/s per GPU
    assert priced["torchtitan-405b-interleaved"].published > priced["torchtitan-405b-1f1b"].published
    assert _tokens(priced, "torchtitan-405b-interleaved") > _tokens(priced, "torchtitan-405b-1f1b")


@pytest.mark.parametrize("variant", ["", "-compile", "-compile-float8"])
def test_an_8b_model_keeps_90_percent_of_its_per_gpu_throughput_from_8_to_128_gpus(priced, variant):
    # torchtitan Tables 1 and 3: 5,762 -> 5,605 (97%), 6,667 -> 6,514, 8,532 -> 8,380
    eight, many = f"torchtitan-8b-8gpu{variant}", f"torchtitan-8b-128gpu{variant}"
    assert priced[many].published / priced[eight].published >= 0.9
    assert _tokens(priced, many) / _tokens(priced, eight) >= 0.9


# the pairs the model ranks as published today; the others are strict expected failures (docs/throughput.md,
# "Rankings": torchtitan's stage split, which the model prices, gives a Megatron-sized pipeline a slower stage)
HOLD_NOW = {"megatron-175b-ptdp-768gpu", "megatron-175b-ptdp-1536gpu", "megatron-530b-ptdp-2240gpu"}
PAIRS = [("megatron-175b-ptdp-384gpu", "megatron-175b-zero3-384gpu"),
         ("megatron-175b-ptdp-768gpu", "megatron-175b-zero3-768gpu"),
         ("megatron-175b-ptdp-1536gpu", "megatron-175b-zero3-1536gpu"),
         ("megatron-530b-ptdp-560gpu", "megatron-530b-zero3-640gpu"),
         ("megatron-530b-ptdp-1120gpu", "megatron-530b-zero3-1120gpu"),
         ("megatron-530b-ptdp-2240gpu", "megatron-530b-zero3-2240gpu")]


@pytest.mark.parametrize(("three_d", "zero3"), [
    pair if pair[0] in HOLD_NOW else pytest.param(*pair, marks=pytest.mark.xfail(
        strict=True, reason="the model ranks ZeRO-3 first here: docs/throughput.md, Rankings"))
    for pair in PAIRS], ids=[pair[0] for pair in PAIRS])
def test_3d_parallelism_beats_zero3_where_it_was_measured_to(priced, three_d, zero3):
    # Narayanan et al. 2021, Table 2: PTD-P above ZeRO-3 without model parallelism at every GPU count
    assert priced[three_d].published > priced[zero3].published
    assert _tokens(priced, three_d) > _tokens(priced, zero3)
