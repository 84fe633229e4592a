"""Staged runs: the plan (parse, checks), the staged loader, the LR across stages, resume
across a boundary, branches (`--from`), and the recipe configs trained from the CLI."""

import numpy as np
import pytest
from conftest import THREE_STAGES, tiny_config

from moelab.config import config_from_dict
from moelab.data.loader import StagedLoader, read_meta
from moelab.errors import ConfigError
from moelab.train.plan import build_plan

def staged(data_path, stages, **sections):
    return config_from_dict({**tiny_config(data_path, train={"steps": 30}, **sections),
                             "stages": stages})


def test_staged_loader_reads_exactly_the_planned_tokens(small_corpus):
    cfg = staged(small_corpus, THREE_STAGES)
    plan = build_plan(cfg)
    assert [(s.start, s.end, s.seq_len, s.batch_size) for s in plan.stages] == [
        (0, 12, 32, 4), (12, 24, 16, 8), (24, 30, 32, 4)]
    loader = StagedLoader(small_corpus, plan.stages, seed=cfg.data.seed)
    meta = read_meta(small_corpus)
    sources = loader.sources
    tokens = {(s.index, src): 0 for s in plan.stages for src in sources}
    read = {}  # (source, seq_len) -> windows in the order read
    for step in range(cfg.train.steps):
        stage = plan.at(step)
        batch = next(loader)
        assert batch.shape == (stage.batch_size, stage.seq_len + 1)
        for row, i, k in zip(batch, *loader.plan(step), strict=True):
            s = stage.seq_len  # the row is the planned window of the planned source
            np.testing.assert_array_equal(row, loader.streams[i][k * s : k * s + s + 1])
            tokens[stage.index, sources[i]] += s
            read.setdefault((sources[i], s), []).append(int(k))
    for stage in plan.stages:
        if stage.mixture:
            w = np.array([stage.mixture.get(src, 0.0) for src in sources])
        else:
            w = np.array([meta["train_tokens"][src] for src in sources], float)
        w = w / w.sum()
        got = np.array([tokens[stage.index, src] for src in sources])
        # the stage trains exactly steps x batch x seq_len tokens ...
        assert got.sum() == (stage.end - stage.start) * stage.batch_size * stage.seq_len
        # ... split by source as its weights say, to the row: a count is an integer number
        # of rows, so the best it can be is within one row (seq_len tokens) of w * tokens
        assert np.all(np.abs(got - w * got.sum()) < stage.seq_len), (stage.index, got)
    assert tokens[2, "prose"] == 0  # the last stage is code only
    # no window read twice while the source has unread ones (one cursor across stages)
    for (src, s), windows in read.items():
        n = loader.windows(src, s)
        first_epoch = windows[:n]
        assert len(set(first_epoch)) == len(first_epoch), (src, s)
    # a pure function of (seed, step): a fresh loader jumps to any step
    again = StagedLoader(small_corpus, plan.stages, seed=cfg.data.seed)
    for step in (0, 11, 12, 13, 24, 29):
        np.testing.assert_array_equal(again.batch(step), loader.batch(step))


@pytest.mark.parametrize("stages, field", [
    ([{"start": 0.5}, {"start": 0.2}], "stages[1].start"),  # unordered
    ([{"start": 5}, {"start": 5}], "stages[1].start"),  # overlapping
    ([{"start": 30}], "stages[0].start"),  # past the end
    ([{"start": 1.0}], "stages[0].start"),  # a fraction of 1 is the end
    ([{"mixture": {"code": 0, "prose": 0}}], "stages[0].mixture"),
    ([{"mixture": {"code": -1, "prose": 2}}], "stages[0].mixture.code"),
    ([{"seq_len": 48}], "stages[0].seq_len"),  # does not divide the tokens per step
    ([{"seq_len": 16, "batch_size": 3}], "stages[0].batch_size"),  # grad_accum 1, but ...
    ([{"start": 10, "restart": {"warmup": 25}}], "stages[0].restart.warmup"),
    ([{"start": 10, "model": {"d_model": 64}}], "stages[0].model"),
    ([{"start": 10, "optimizer": "new"}], "stages[0].optimizer"),
])
def test_bad_plans_are_one_line_errors_naming_the_field(small_corpus, stages, field):
    optim = {"grad_accum": 2} if "batch_size" in str(stages) else {}
    with pytest.raises(ConfigError) as err:
        staged(small_corpus, stages, optim=optim)
    message = str(err.value)
    assert message.startswith(field) and "\n" not in message, message
