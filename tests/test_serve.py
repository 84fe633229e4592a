"""`moelab serve`: the OpenAI-compatible server, driven by the official `openai` client
against 127.0.0.1 (completions, chat, streaming, bad requests, a disconnect, concurrent
requests), and lm-evaluation-harness's `local-completions` through it against the
in-process adapter."""

import contextlib
import json
import threading
import time

import httpx
import numpy as np
import pytest
import yaml
from conftest import tiny_config, write_corpus
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from moelab.cli import main  # noqa: E402
from moelab.export.generate import generate  # noqa: E402
from moelab.serve.app import create_app  # noqa: E402
from moelab.serve.cli import listen  # noqa: E402
from moelab.serve.engine import Engine  # noqa: E402

SEQ_LEN = 128  # room for a chat prompt and a reply, and for lm-eval's scoring requests


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two domains of made-up-word documents, 40% held out (enough for the local tasks),
    the chat tokens in the tokenizer; a tiny model trained 3 steps on them."""
    from moelab.data.prepare import prepare

    root = tmp_path_factory.mktemp("serve")
    sources = {name: write_corpus(root / "raw", name, 20, 400, seed)
               for seed, name in enumerate(["code", "prose"])}
    prepare(root / "data", sources, vocab_size=400, val_fraction=0.4, chat_tokens=True)
    config = root / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config(root / "data", data={"seq_len": SEQ_LEN},
                                                 train={"steps": 3, "checkpoint_every": 3,
                                                        "eval_every": 3, "log_every": 3})))
    assert main(["train", "--config", str(config), "--run-dir", str(root / "run")]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def engine(run):
    return Engine.load(run)


@contextlib.contextmanager
def serving(engine, slots):
    """The app on a free 127.0.0.1 port, uvicorn in a thread; yields the base URL."""
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, slots), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def url(engine):
    with serving(engine, slots=2) as base:
        yield base


def client(url, **kwargs):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, **kwargs)


def slow_steps(monkeypatch, engine, seconds):
    """Slows each decoding step by `seconds` and logs (request, event) pairs in order:
    ("token", i) per step of request i, ("closed", i) when its decoding is closed."""
    events = []
    tokens = engine.tokens

    def slowed(prompt_ids, *args):
        request = prompt_ids[0]  # the tests tell requests apart by their first token
        try:
            for token in tokens(prompt_ids, *args):
                time.sleep(seconds)
                events.append(("token", request))
                yield token
        finally:
            events.append(("closed", request))

    monkeypatch.setattr(engine, "tokens", slowed)
    return events


def test_completions_match_in_process_generate(engine, url):
    api = client(url)
    (model,) = api.models.list().data
    assert model.id == engine.name and model.max_model_len == engine.context
    prompt = "ab cde fgh\nijk"
    ids = engine.encode(prompt)
    greedy = generate(engine.model, ids, 12, eos_id=engine.eos_id)
    out = api.completions.create(model=engine.name, prompt=prompt, max_tokens=12,
                                 temperature=0)
    expected = engine.decode([t for t in greedy if t != engine.eos_id])
    assert out.choices[0].text == expected
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(greedy)
    # the same prompt as token ids; sampling is seeded: same seed, same tokens as generate
    by_ids = api.completions.create(model=engine.name, prompt=ids, max_tokens=12,
                                    temperature=0)
    assert by_ids.choices[0].text == expected
    sampled = generate(engine.model, ids, 12, temperature=1.0, top_p=0.9, seed=7,
                       eos_id=engine.eos_id)
    for _ in range(2):
        again = api.completions.create(model=engine.name, prompt=prompt, max_tokens=12,
                                       temperature=1.0, top_p=0.9, seed=7)
        assert again.choices[0].text == engine.decode(
            [t for t in sampled if t != engine.eos_id])
    # logprobs: a greedy token is the most likely one, so its log-prob is the top one's
    scored = api.completions.create(model=engine.name, prompt=prompt, max_tokens=4,
                                    temperature=0, logprobs=2, echo=True)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
    for token_lp, top in zip(lp.token_logprobs[len(ids):], lp.top_logprobs[len(ids):],
                             strict=True):
        assert len(top) == 2 and token_lp == max(top.values())
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    # a stop string cuts the text before it, streamed or not
    stop = expected[5:8]
    cut = expected[: expected.find(stop)]
    stopped = api.completions.create(model=engine.name, prompt=prompt, max_tokens=12,
                                     temperature=0, stop=[stop])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (cut, "stop")
    pieces = api.completions.create(model=engine.name, prompt=prompt, max_tokens=12,
                                    temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == cut


def test_chat_and_its_stream(engine, url):
    from moelab.data.chat import END_OF_TURN, encode_chat

    api = client(url)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "what is abc"}]
    reply = api.chat.completions.create(model=engine.name, messages=messages, max_tokens=10,
                                        temperature=0)
    ids = encode_chat(engine.tokenizer, messages, add_generation_prompt=True,
                      template=engine.chat_template)[0]
    assert engine.decode(ids).endswith("<|im_start|>assistant\n")
    greedy = generate(engine.model, ids, 10)
    stop = engine.tokenizer.token_to_id(END_OF_TURN)
    if stop in greedy:
        greedy = greedy[: greedy.index(stop)]
    assert reply.choices[0].message.content == engine.decode(greedy)
    assert reply.choices[0].message.role == "assistant"
    chunks = list(api.chat.completions.create(model=engine.name, messages=messages,
                                              max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_bad_requests_get_4xx_json(engine, url):
    name, room = engine.name, engine.context
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    cases = [  # (path, body, status, words in the message)
        ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "does not exist"),
        ("/v1/completions", {"model": name, "prompt": "a", "max_tokens": "many"}, 400,
         "max_tokens"),
        ("/v1/completions", {"model": name, "prompt": "a", "max_tokens": -1}, 400,
         "max_tokens"),
        ("/v1/completions", {"model": name, "prompt": "a", "max_tokens": room + 1}, 400,
         "max_tokens"),
        ("/v1/completions", {"model": name, "prompt": "ab " * 200}, 400, "context length"),
        ("/v1/completions", {"model": name, "prompt": [1, 10**6]}, 400, "vocabulary"),
        ("/v1/completions", {"model": name, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": name, "prompt": "a", "temperature": 3}, 400,
         "temperature"),
        ("/v1/completions", {"model": name, "prompt": "a", "n": 2}, 400, "n"),
        ("/v1/completions", {"model": name, "prompt": "a", "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"prompt": "a"}, 400, "model"),
        ("/v1/chat/completions", {**chat, "messages": []}, 400, "non-empty"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "robot", "content": "x"}]},
         400, "role"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "y"}]},
         400, "last turn"),
        ("/v1/chat/completions", {**chat, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {**chat, "messages": "hi"}, 400, "messages"),
        ("/v1/nothing", {}, 404, "Not Found"),
    ]
    with httpx.Client(base_url=url, timeout=30) as http:
        answers = [(http.post(path, json=body), status, words)
                   for path, body, status, words in cases]
        answers.append((http.post("/v1/completions", content=b"{not json",
                                  headers={"content-type": "application/json"}), 400, "JSON"))
        # JSON may escape a lone surrogate, which no tokenizer encodes (a 500 before)
        for path, body in [("/v1/completions", {"model": name, "prompt": "a\ud800"}),
                           ("/v1/completions", {"model": name, "prompt": ["ok", "\udc80"]}),
                           ("/v1/completions", {"model": name, "prompt": "a", "stop": "\ud800"}),
                           ("/v1/chat/completions",
                            {**chat, "messages": [{"role": "user", "content": "\ud800"}]})]:
            answers.append((http.post(path, content=json.dumps(body),
                                      headers={"content-type": "application/json"}),
                            400, "not UTF-8 text"))
    for answer, status, words in answers:
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert words in error["message"] and error["type"], error
        assert "Traceback" not in answer.text
    # the official client raises its typed errors from these answers
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="gpt-4", prompt="a")
    with pytest.raises(openai.BadRequestError, match="context length"):
        client(url).chat.completions.create(model=name, messages=chat["messages"],
                                            max_tokens=room)


# Fuzz: wild request bodies on every endpoint. Valid values are drawn beside wild ones so
# that some requests are served (short: max_tokens of a few tokens, prompts of a few
# words) and the rest are refused; none may end in a 5xx or a body without its error.
WILD = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                 st.lists(st.integers(-3, 10**7), max_size=4),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
FUZZ_CASES = 80  # ~0.2 s each on 2 cores: most are refused before the model runs


def _bodies(name: str):
    """(path, body): bodies of valid values only (served), the same with wild values
    beside the valid ones (mostly refused), and raw bytes or wild JSON on any endpoint."""
    few = st.integers(0, 3)

    def fields(wild: bool):
        def pick(valid):
            return st.one_of(valid, WILD) if wild else valid

        common = {"temperature": pick(st.sampled_from([0, 0.7, 2])),
                  "top_p": pick(st.sampled_from([1, 0.5])),
                  "stop": pick(st.one_of(st.text(min_size=1, max_size=3),
                                         st.lists(st.text(min_size=1, max_size=3),
                                                  max_size=4))),
                  "stream": pick(st.booleans()), "seed": pick(few), "n": pick(st.just(1)),
                  "user": pick(st.text(max_size=4))}
        if wild:
            common["bogus_field"] = WILD
        model = pick(st.just(name)) if not wild else st.one_of(
            st.just(name), st.just("gpt-4"), WILD)
        message = st.fixed_dictionaries(
            {"role": pick(st.sampled_from(["system", "user"])),
             "content": pick(st.text(max_size=16))})
        completion = st.fixed_dictionaries(
            {"model": model,
             "prompt": pick(st.one_of(st.sampled_from(["ab cd", "x", "\x00\udc80 xy"]),
                                      st.lists(st.integers(0, 300), min_size=1, max_size=4),
                                      st.lists(st.text(min_size=1, max_size=6), min_size=1,
                                               max_size=2)))},
            optional={**common, "max_tokens": pick(st.integers(1, 3)),
                      "logprobs": pick(few), "echo": pick(st.booleans())})
        chat = st.fixed_dictionaries(
            {"model": model,
             "messages": pick(st.lists(message, min_size=1, max_size=2).map(
                 lambda ms: [*ms[:-1], {**ms[-1], "role": "user"}]))},
            optional={**common, "max_tokens": pick(st.integers(1, 3)),
                      "max_completion_tokens": pick(st.integers(1, 3))})
        return [st.tuples(st.just("/v1/completions"), completion),
                st.tuples(st.just("/v1/chat/completions"), chat)]

    raw = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models"]),
                    st.one_of(WILD, st.binary(max_size=20)))
    return st.one_of(*fields(False), *fields(True), raw)


def test_fuzz_requests_never_a_5xx(engine, url):
    """Every answer is a 2xx with its body, or a 4xx whose JSON carries the error."""
    seen = {"ok": 0, "refused": 0}

    @settings(max_examples=FUZZ_CASES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=_bodies(engine.name))
    def check(case):
        path, body = case
        with httpx.Client(base_url=url, timeout=60) as http:
            if isinstance(body, bytes):
                answer = http.post(path, content=body,
                                   headers={"content-type": "application/json"})
            else:  # NaN and infinities go out as JSON's common extension (NaN, Infinity)
                answer = http.post(path, content=json.dumps(body),
                                   headers={"content-type": "application/json"})
        assert answer.status_code < 500, (case, answer.text)
        assert "Traceback" not in answer.text, case
        if answer.status_code >= 400:
            seen["refused"] += 1
            error = answer.json()["error"]
            assert isinstance(error["message"], str) and error["message"], (case, error)
        else:
            seen["ok"] += 1
            if answer.headers["content-type"].startswith("text/event-stream"):
                events = [ln for ln in answer.text.splitlines() if ln]
                assert events and events[-1] == "data: [DONE]", (case, answer.text)
                assert all(ln.startswith("data: ") for ln in events), (case, answer.text)
            else:
                assert answer.json()["object"], case

    check()
    # the draws reach both sides (guards against a strategy that only makes garbage)
    assert seen["ok"] >= 5 and seen["refused"] >= 20, seen


def test_a_disconnect_mid_stream_frees_the_slot(engine, monkeypatch):
    events = slow_steps(monkeypatch, engine, 0.05)
    with serving(engine, slots=1) as base:
        api = client(base, timeout=30)
        # 50 new tokens: the cache shapes of the other tests, so nothing new compiles
        stream = api.completions.create(model=engine.name, prompt="ab cd", max_tokens=50,
                                        temperature=0, stream=True)
        next(iter(stream))
        stream.close()  # the client goes away after the first chunk
        first = engine.encode("ab cd")[0]
        deadline = time.monotonic() + 5
        while ("closed", first) not in events and time.monotonic() < deadline:
            time.sleep(0.02)
        steps = events.count(("token", first))
        assert ("closed", first) in events and steps < 25, steps  # decoding stopped early
        # the one slot is free: the next request is served
        out = api.completions.create(model=engine.name, prompt="xy", max_tokens=3,
                                     temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")


def test_concurrent_requests_each_get_their_own_output(engine, url, monkeypatch):
    prompts = {"ab cd ef": 1, "xyz uvw": 2}  # prompt -> seed
    alone = {p: engine.decode([t for t in generate(
        engine.model, engine.encode(p), 16, temperature=1.0, seed=s, eos_id=engine.eos_id)
        if t != engine.eos_id]) for p, s in prompts.items()}
    events = slow_steps(monkeypatch, engine, 0.02)
    got = {}

    def ask(prompt):
        got[prompt] = client(url).completions.create(
            model=engine.name, prompt=prompt, max_tokens=16, temperature=1.0,
            seed=prompts[prompt]).choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == alone
    order = [r for kind, r in events if kind == "token"]
    switches = sum(a != b for a, b in zip(order, order[1:], strict=False))
    assert switches >= 2, order  # the two decodings interleaved (2 slots), yet never mixed


def test_lm_eval_through_the_server_equals_the_in_process_adapter(engine, url, run, tmp_path):
    """lm-eval's `local-completions` with its `remote` tokenizer (the server's /tokenize:
    no tokenizer files, no network) scores every request as the in-process adapter scores
    the same tokens, so the task numbers are the same."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval's API models need it (the eval extra)
    from lm_eval.api.registry import get_model

    from moelab.config import data_dir
    from moelab.eval.harness import ROWS, make_lm, model_logits_fn, run_tasks
    from moelab.eval.tasks import write_tasks

    names = ["cont_prose"]  # one local task, 6 items (24 requests): the test's time
    written = write_tasks(data_dir(engine.cfg.data.path), engine.tokenizer, names, tmp_path,
                          6, seed=0)
    remote = get_model("local-completions")(
        model=engine.name, base_url=f"{url}/v1/completions", tokenizer_backend="remote",
        tokenized_requests=True, max_length=engine.context, max_retries=1)
    scored = {}
    through_server = remote.loglikelihood

    def record(requests, disable_tqdm=False):
        out = through_server(requests, disable_tqdm=True)
        scored.update(zip([r.args for r in requests], out, strict=True))
        return out

    remote.loglikelihood = record
    server_scores = run_tasks(remote, tmp_path, names)
    # the adapter on the very tokens lm-eval sent: its tokenization (the context's trailing
    # whitespace moved into the continuation) and its left truncation to max_length
    adapter = make_lm(model_logits_fn(engine.model, engine.cfg.train.dtype), engine.tokenizer,
                      engine.context)
    args = list(scored)
    inputs, ctxlens, _ = remote.batch_loglikelihood_requests(
        [[(None, *remote._encode_pair(*a)) for a in args]])
    pairs = [(i[:c], i[c:]) for i, c in zip(inputs, ctxlens, strict=True)]
    local = dict(zip(args, [s for at in range(0, len(pairs), ROWS)
                            for s in adapter._score(pairs[at : at + ROWS])], strict=True))
    for a in args:
        # float32 logits from two programs (batch 1 over the server, batch 16 here) agree
        # to a few ulps (1e-7 relative); summed over <= 128 tokens that stays below 1e-5
        # of the total log-likelihood
        assert scored[a][0] == pytest.approx(local[a][0], rel=1e-5, abs=1e-6)
        assert scored[a][1] == local[a][1]
    for name in names:
        items = [json.loads(line) for line in written[name].read_text().splitlines()]
        lls = np.array([[local[(it["context"], c)][0] for c in it["choices"]]
                        for it in items])
        lengths = np.array([[len(c) for c in it["choices"]] for it in items])
        gold = np.array([it["gold"] for it in items])
        assert server_scores[name]["acc"] == np.mean(lls.argmax(1) == gold)
        assert server_scores[name]["acc_norm"] == np.mean((lls / lengths).argmax(1) == gold)
        assert server_scores[name]["n"] == len(items)


def test_serve_startup_errors_are_one_line(run, tmp_path, capsys):
    taken = listen("127.0.0.1", 0)  # listening: another server's port
    cases = [([str(tmp_path / "missing")], "not a run directory"),
             ([str(tmp_path)], "no checkpoint"),
             ([str(run), "--step", "7"], "7"),
             ([str(run), "--port", str(taken.getsockname()[1])], "cannot listen")]
    for argv, words in cases:
        assert main(["serve", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    taken.close()
    # a broken chat template stops the server at startup, not at the first chat request
    from moelab.config import data_dir
    from moelab.data.chat import CHAT_TEMPLATE_FILE

    template = data_dir(Engine.load(run).cfg.data.path) / CHAT_TEMPLATE_FILE
    good = template.read_text()
    try:
        template.write_text("{% for message in messages %}{{ message['content'] }}")
        assert main(["serve", str(run)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "chat template" in err, err
    finally:
        template.write_text(good)
