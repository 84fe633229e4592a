"""`data.unique_tokens`: a run reads only the first K train tokens of a source (a fixed
unique subset, as Muennighoff et al.'s repetition rungs), and passes are counted against K."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from conftest import tiny_config
from test_ladder_passes import CODE, PROSE, fake_corpus, two_stage_spec

from moelab.config import ConfigError, config_from_dict
from moelab.data.loader import (
    SUBSET_PIECE,
    Loader,
    StagedLoader,
    read_meta,
    restrict,
    unique_subset,
)
from moelab.errors import UserError
from moelab.ladder import repetition
from moelab.ladder.spec import spec_from_dict


def test_every_row_of_a_limited_source_lies_in_its_first_tokens(small_corpus):
    """Prose limited to its first 40 windows of 32 tokens (+1, a window's target): every
    prose row of 200 batches is a slice of those 1281 tokens, and across the batches the
    rows cover most of the 40 windows (drawn uniformly, 200 x ~2 prose rows); code is
    unlimited and reaches past that prefix."""
    meta = read_meta(small_corpus)
    limit = 40 * 32 + 1
    loader = Loader(small_corpus, "train", 32, 4, {"code": 1, "prose": 1}, seed=3,
                    unique_tokens={"prose": limit})
    full = np.load(small_corpus / "prose.train.npy", mmap_mode="r")
    prose = loader.components.index("prose")
    seen_windows, code_beyond = set(), False
    for step in range(200):
        sources, windows = loader.plan(step)
        rows = loader.batch(step)
        for src, w, row in zip(sources, windows, rows, strict=True):
            if src == prose:
                assert (w + 1) * 32 + 1 <= limit
                np.testing.assert_array_equal(row, full[w * 32:w * 32 + 33])
                seen_windows.add(int(w))
            else:
                code_beyond |= (w + 1) * 32 > limit
    assert len(seen_windows) > 30 and code_beyond
    assert meta["train_tokens"]["prose"] > limit  # the limit really cut something


def test_a_staged_run_reads_the_subset_epoch_after_epoch(small_corpus):
    """Staged: prose limited to 10 windows of 32 tokens; 30 prose rows are three full
    epochs over exactly those 10 windows (a staged loader reads without replacement)."""
    cfg = config_from_dict(tiny_config(small_corpus, stages=[{"mixture": {"prose": 1.0}}],
                                       train={"steps": 15}, data={"batch_size": 2}))
    loader = StagedLoader(small_corpus, cfg.plan.stages, seed=1,
                          unique_tokens={"prose": 10 * 32 + 1})
    full = np.load(small_corpus / "prose.train.npy", mmap_mode="r")
    starts = []
    for step in range(15):
        for row in loader.batch(step):
            hits = [w for w in range(10) if np.array_equal(row, full[w * 32:w * 32 + 33])]
            assert len(hits) == 1
            starts.append(hits[0])
    assert sorted(starts) == sorted(list(range(10)) * 3)


def test_passes_count_against_the_subset_and_the_mixture_keeps_full_sizes(tmp_path, capsys):
    """The two-stage spec of test_ladder_passes (rung w16: 2240 code, 2880 prose tokens)
    with prose limited to 1000 tokens: prose passes 2.88 instead of 0.72; code unchanged.
    A mixture of {} still weighs by the full sizes (10000 : 4000)."""
    data = fake_corpus(tmp_path / "data")
    raw = two_stage_spec(data)
    raw["base"]["data"]["unique_tokens"] = {"prose": 1000}
    spec = spec_from_dict(raw, "limited", tmp_path / "ladder")
    rep = repetition.repetition(spec)
    assert rep["runs"]["w16"][-1]["cumulative"] == pytest.approx(
        {"code": 2240 / CODE, "prose": 2880 / 1000})
    meta = restrict(read_meta(data), {"prose": 1000})
    from moelab.data.loader import mixture_weights

    np.testing.assert_allclose(mixture_weights(meta, "train", {}),
                               [CODE / (CODE + PROSE), PROSE / (CODE + PROSE)])
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    from moelab import cli

    assert cli.main(["ladder", "plan", str(path)]) == 0
    assert "prose 0.96 (by its end 2.88)" in capsys.readouterr().out


@pytest.mark.parametrize("limit, message", [
    ({"prose": 10}, "must be a whole number of tokens > data.seq_len=32"),
    ({"prose": 2.5e3}, "data.unique_tokens.prose: expected int"),
    ({"prose": True}, "data.unique_tokens.prose"),
    ({"cell:d00/q0": 100}, "names sources only"),
])
def test_bad_limits_are_config_errors(small_corpus, limit, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(tiny_config(small_corpus, data={"unique_tokens": limit}))


def test_a_limit_the_dataset_cannot_meet_is_one_line(small_corpus):
    have = read_meta(small_corpus)["train_tokens"]["prose"]
    with pytest.raises(UserError, match=r"prose asks for \d+ train tokens but the dataset "
                       rf"holds {have}"):
        Loader(small_corpus, unique_tokens={"prose": have + 1})
    with pytest.raises(UserError, match=r"names source\(s\) \['poetry'\]"):
        Loader(small_corpus, unique_tokens={"poetry": 1000})


def test_a_spread_subset_spans_the_stream_and_reads_only_its_pieces(small_corpus):
    """data.unique_sample: spread. On a stream of positions (np.arange), the subset holds
    exactly K tokens (passes count against K either way) in contiguous pieces of about
    SUBSET_PIECE, one at the start of each equal segment: the first at 0, the last in the
    stream's last segment, where "first" never reaches. On a real corpus every prose row a
    loader draws is a window of that subset."""
    stream = np.arange(100 * SUBSET_PIECE)
    k = 5 * SUBSET_PIECE
    first, spread = unique_subset(stream, k, "first"), unique_subset(stream, k, "spread")
    assert len(first) == len(spread) == k and first[-1] == k - 1
    breaks = np.flatnonzero(np.diff(spread) != 1) + 1  # where one piece ends
    starts = spread[np.concatenate([[0], breaks])]
    np.testing.assert_array_equal(starts, np.arange(5) * 20 * SUBSET_PIECE)
    assert np.all(np.diff(np.concatenate([breaks, [k]]), prepend=0) == SUBSET_PIECE)
    assert unique_subset(stream, None, "spread") is stream
    assert unique_subset(stream, len(stream) + 1, "spread") is stream

    full = np.load(small_corpus / "prose.train.npy", mmap_mode="r")
    k = len(full) // 3
    assert k > 2 * SUBSET_PIECE  # so the subset is more than one piece
    sub = unique_subset(full, k, "spread")
    windows = {tuple(sub[w * 32:w * 32 + 33].tolist()) for w in range((len(sub) - 1) // 32)}
    loader = Loader(small_corpus, "train", 32, 4, {"prose": 1}, seed=3,
                    unique_tokens={"prose": k}, unique_sample="spread")
    assert all(tuple(row.tolist()) in windows for step in range(20) for row in loader.batch(step))
    assert not np.array_equal(sub, full[:k])


def test_unique_sample_is_checked():
    with pytest.raises(ConfigError, match="data.unique_sample"):
        config_from_dict({"data": {"unique_sample": "random"}})
