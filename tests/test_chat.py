"""Conversations: the chat template's mask, its parity with transformers, validation,
packing with segment ids (no attention across conversations, each one's loss unchanged)."""

import random

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import STDLIB, words_text

from moelab.config import config_from_dict
from moelab.data.chat import (
    CHAT_TEMPLATE,
    END_OF_TURN,
    encode_all,
    encode_chat,
    pack,
    read_conversations,
)
from moelab.errors import UserError
from moelab.model.transformer import Transformer
from moelab.train.step import make_loss

VOCAB = 320


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A BPE with the chat tokens, trained on real stdlib text (a second on two cores)."""
    from moelab.data.tokenizer import train_tokenizer

    texts = [open(f"{STDLIB}/json/{name}.py").read() for name in ("encoder", "decoder")]
    return train_tokenizer(texts, VOCAB, chat_tokens=True)


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """n conversations of 1-2 exchanges of random words, some with a system turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": words_text(rng, 3)}] if i % 2 else []
        for _ in range(rng.randint(1, 2)):
            turns += [{"role": "user", "content": words_text(rng, rng.randint(1, 4)) + "?"},
                      {"role": "assistant", "content": words_text(rng, rng.randint(1, 4))}]
        out.append(turns)
    return out


def test_the_chat_tokens_are_the_last_ids_and_the_merges_stay(chat_tokenizer):
    from moelab.data.tokenizer import EOS, train_tokenizer

    texts = [open(f"{STDLIB}/json/{name}.py").read() for name in ("encoder", "decoder")]
    plain = train_tokenizer(texts, VOCAB)
    assert [chat_tokenizer.token_to_id(t) for t in ("<|im_start|>", END_OF_TURN)] == [
        VOCAB - 2, VOCAB - 1]
    assert plain.token_to_id("<|im_start|>") is None
    assert chat_tokenizer.token_to_id(EOS) == plain.token_to_id(EOS)
    same = {k: v for k, v in chat_tokenizer.get_vocab().items() if v < VOCAB - 2}
    # the chat BPE is the plain one less its last two merges
    assert same == {k: v for k, v in plain.get_vocab().items() if v < VOCAB - 2}


def test_the_mask_covers_exactly_the_assistant_replies(chat_tokenizer):
    for messages in conversations(6):
        ids, mask = encode_chat(chat_tokenizer, messages)
        masked = [i for i, m in zip(ids, mask, strict=True) if m]
        replies = "".join(t["content"] + END_OF_TURN for t in messages
                          if t["role"] == "assistant")
        assert chat_tokenizer.decode(masked, skip_special_tokens=False) == replies
        assert sum(mask) < len(ids)


def test_apply_chat_template_of_the_export_gives_moelabs_ids(chat_tokenizer, tmp_path):
    """The exported tokenizer_config.json carries the template: transformers'
    apply_chat_template gives encode_chat's ids and mask, with and without the prompt."""
    from transformers import AutoTokenizer

    from moelab.export.hf import _tokenizer_files

    cfg = config_from_dict({"model": {"vocab_size": VOCAB}})
    files, _ = _tokenizer_files(chat_tokenizer, cfg, CHAT_TEMPLATE)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for messages in conversations(8, seed=1):
        ids, mask = encode_chat(chat_tokenizer, messages)
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert out["input_ids"] == ids and out["assistant_masks"] == mask
        prompt, _ = encode_chat(chat_tokenizer, messages[:-1], add_generation_prompt=True)
        assert hf.apply_chat_template(messages[:-1], tokenize=True, return_dict=True,
                                      add_generation_prompt=True)["input_ids"] == prompt


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": "hi"}]}', "last turn must be the assistant"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "where user was expected"),
    ('{"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "a"}]}',
     "non-empty string"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "must be one of"),
    ('{"messages": []}', "non-empty list"),
    ('{"turns": []}', "expected an object with 'messages'"),
    ("{not json", "not JSON"),
])
def test_a_bad_conversation_is_one_line_naming_file_and_line(tmp_path, line, message):
    good = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
    path = tmp_path / "chat.jsonl"
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(UserError, match=message) as err:
        read_conversations(path)
    assert f"{path}:3:" in str(err.value) and "\n" not in str(err.value)


def test_a_conversation_longer_than_a_row_is_refused(chat_tokenizer, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "q"}, '
                    f'{{"role": "assistant", "content": "{"word " * 40}"}}]}}\n')
    with pytest.raises(UserError, match=f"{path}:1: .*longer than a row of seq_len"):
        encode_all(chat_tokenizer, read_conversations(path), seq_len=32)


def test_packing_lays_conversations_whole_with_restarting_positions(chat_tokenizer):
    encoded = [encode_chat(chat_tokenizer, m) for m in conversations(10)]
    packed = pack(encoded, 127, pad_id=0)
    assert packed.tokens.shape[1] == 128
    assert sum(s.max() for s in packed.segments) == len(encoded)  # none lost, none split
    order = iter(encoded)
    for tokens, segments, positions, mask in zip(packed.tokens, packed.segments,
                                                 packed.positions, packed.loss_mask,
                                                 strict=True):
        for seg in range(1, segments.max() + 1):
            at = segments == seg
            ids, conv_mask = next(order)
            assert tokens[at].tolist() == ids and mask[at].tolist() == conv_mask
            assert positions[at].tolist() == list(range(len(ids)))
        assert not mask[segments == 0].any()


def tiny_model():
    cfg = config_from_dict({
        "model": {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 4,
                  "n_kv_heads": 2, "d_ff": 32},
        "moe": {"n_experts": 4, "top_k": 2, "dispatch": "dropless"}})
    return Transformer.init(cfg.model, cfg.moe, jax.random.key(0)), cfg


# Tolerance: packed and one-per-row compute the same float32 sums over other shapes (other
# padding, other row lengths), so rounding differs at ~1e-6 of values of order 1-10 over
# 2 layers; the masked keys contribute exactly 0 (exp of float32 min). 1e-5 leaves 10x.
def test_packing_changes_no_conversations_loss(chat_tokenizer):
    """Each conversation's masked loss, packed several to a row, equals its loss alone in a
    row of its own; and the packed batch's mean through the train loss is their mean."""
    model, cfg = tiny_model()
    encoded = [encode_chat(chat_tokenizer, m) for m in conversations(8, seed=2)]
    packed = pack(encoded, 127, pad_id=0)
    assert len(packed) < len(encoded)  # several conversations share a row

    def token_losses(rows):
        logits, _, _ = eqx.filter_jit(model)(jnp.asarray(rows.tokens[:, :-1]),
                                             segments=jnp.asarray(rows.segments[:, :-1]),
                                             positions=jnp.asarray(rows.positions[:, :-1]))
        lse = jax.nn.logsumexp(logits, -1)
        target = jnp.take_along_axis(logits, jnp.asarray(rows.tokens[:, 1:, None]), -1)[..., 0]
        return np.asarray(lse - target) * rows.loss_mask[:, 1:]

    together = token_losses(packed)
    alone = [pack([e], 127, pad_id=0) for e in encoded]  # one conversation a row
    per_row = token_losses(type(packed)(*(np.concatenate([getattr(a, f) for a in alone])
                                          for f in ("tokens", "segments", "positions",
                                                    "loss_mask"))))
    sums = []  # each conversation's summed loss, in order
    for r, segs in enumerate(packed.segments[:, 1:]):
        sums += [together[r][segs == seg].sum() for seg in range(1, segs.max() + 1)]
    np.testing.assert_allclose(sums, [row.sum() for row in per_row], rtol=1e-5, atol=1e-5)
    # the train loss is the mean over masked-in targets of the batch
    (_, parts) = eqx.filter_jit(make_loss(cfg))(model, {k: jnp.asarray(v) for k, v in packed.batch(
        np.arange(len(packed))).items()})
    mean = sum(row.sum() for row in per_row) / sum(int(np.sum(m)) for _, m in encoded)
    np.testing.assert_allclose(float(parts["ce"]), mean, rtol=1e-5)


def test_no_attention_crosses_a_conversation(chat_tokenizer):
    """Changing the first conversation of a row leaves the second one's logits as they
    were; without segments (one causal sequence) they change."""
    model, _ = tiny_model()
    first, second = (encode_chat(chat_tokenizer, m) for m in conversations(2, seed=3))
    other = encode_chat(chat_tokenizer, conversations(1, seed=4)[0])
    rows = [pack([a, second], 191, pad_id=0) for a in (first, other)]
    assert all(len(r) == 1 for r in rows)

    def logits_of_second(rows, segmented=True):
        at = rows.segments[0, :-1] == 2
        logits, _, _ = eqx.filter_jit(model)(
            jnp.asarray(rows.tokens[:, :-1]),
            segments=jnp.asarray(rows.segments[:, :-1]) if segmented else None,
            positions=jnp.asarray(rows.positions[:, :-1]) if segmented else None)
        return np.asarray(logits[0])[at]

    np.testing.assert_allclose(logits_of_second(rows[0]), logits_of_second(rows[1]), atol=1e-5)
    assert np.abs(logits_of_second(rows[0], False) - logits_of_second(rows[1], False)
                  ).max() > 1e-3


def test_the_conversation_loader_draws_every_row_once_an_epoch(chat_tokenizer, tmp_path):
    """Batches are a function of the step; an epoch's batches hold each packed row once; a
    corpus without the chat tokens is refused in one line."""
    import json

    from moelab.data.chat import CHAT_TEMPLATE_FILE
    from moelab.data.loader import ConversationLoader
    from moelab.data.tokenizer import train_tokenizer

    (tmp_path / "tokenizer.json").write_text(chat_tokenizer.to_str())
    (tmp_path / CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE)
    (tmp_path / "meta.json").write_text(json.dumps({
        "vocab_size": VOCAB, "eos_id": 0, "sources": ["code"], "train_tokens": {"code": 0},
        "val_tokens": {"code": 0}}))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(24)))
    loader = ConversationLoader(tmp_path, path, seq_len=127, batch_size=2, seed=3)
    rows = len(loader.rows)
    drawn = np.concatenate([loader.plan(step) for step in range(rows)])  # two epochs
    assert sorted(drawn[:rows]) == sorted(drawn[rows:]) == list(range(rows))
    again = ConversationLoader(tmp_path, path, seq_len=127, batch_size=2, seed=3)
    for key, value in loader.batch(5).items():
        np.testing.assert_array_equal(value, again.batch(5)[key])
    texts = [open(f"{STDLIB}/json/{name}.py").read() for name in ("encoder", "decoder")]
    (tmp_path / "tokenizer.json").write_text(train_tokenizer(texts, VOCAB).to_str())
    with pytest.raises(UserError, match="lacks the chat token"):
        ConversationLoader(tmp_path, path, seq_len=127, batch_size=2)


def test_sft_branches_from_a_base_with_its_own_schedule_and_trains_on_replies(
        small_corpus, tmp_path):
    """A base on the small corpus (its tokenizer given the chat tokens), then `--from BASE
    --weights-only` onto conversations under a restart stage: the branch trains, records
    its lineage, and trains to its last step on the packed conversations."""
    import json
    import shutil

    import yaml
    from conftest import losses, tiny_config

    from moelab.cli import main
    from moelab.data.chat import CHAT_TEMPLATE_FILE, SPECIAL_TOKENS
    from moelab.data.tokenizer import load_tokenizer

    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    tokenizer = load_tokenizer(corpus)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))  # ids 512, 513
    (corpus / "tokenizer.json").write_text(tokenizer.to_str())
    (corpus / CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(12)))
    model = {"vocab_size": 520}
    train = {"steps": 4, "checkpoint_every": 4, "eval_every": 4, "log_every": 2}
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(tiny_config(corpus, model=model, train=train)))
    assert main(["train", "--config", str(base), "--run-dir", str(tmp_path / "base")]) == 0
    sft = tmp_path / "sft.yaml"
    sft.write_text(yaml.safe_dump(tiny_config(
        corpus, model=model, train={**train, "steps": 8},
        data={"conversations": str(chats), "seq_len": 128},
        stages=[{"mixture": {}}, {"start": 4, "optimizer": "fresh",
                                  "restart": {"warmup": 1, "decay": "cosine"}}])))
    assert main(["train", "--config", str(sft), "--run-dir", str(tmp_path / "sft"),
                 "--from", str(tmp_path / "base"), "--weights-only"]) == 0
    lineage = json.loads((tmp_path / "sft" / "lineage.json").read_text())
    assert lineage["step"] == 4 and lineage["optimizer_state"] == "fresh"
    logged = losses(tmp_path / "sft")
    assert min(logged) > 4 and max(logged) == 8  # only the branch's steps, all finite
    assert all(np.isfinite(v) for v in logged.values())
