"""Structured outputs of `--serve` (mdi.model.constraints.constraint, llguidance): JSON schemas, GBNF
grammars and regexes are obeyed token by token on a real 3-node SmolLM2 ring, streamed and
whole, through the official `openai` client; constrained and free samples share the ring's
frames without changing the free ones; every bad schema or grammar is one 400 naming its field.
"""
import json
import re
import threading

import numpy as np
import pytest
import requests

from conftest import ServeProcess, save_test_model
from ringconfigs import write_run_config
from mdi.model.constraints.grammar_spec import GrammarSpec
from mdi.model.tokenizers import char_tokenizer, gpt2_tokenizer, load_tokenizer

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from mdi.model.constraints.constraint import ConstraintError, GrammarCompiler  # noqa: E402 (after the skip)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "color": {"type": "string", "enum": ["red", "green", "blue"]}}}


def _obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(required if required is not None else props),
            "additionalProperties": False}


S = {"type": "string", "maxLength": 24}
SCHEMAS = [  # (prompt, schema): nested objects, enums, arrays, required keys, numbers, booleans
    ("Describe a person as JSON.", PERSON),
    ("A city and its country, as JSON.", _obj({"city": S, "country": S})),
    ("A book as JSON.", _obj({"title": S, "author": S, "year": {"type": "integer"}})),
    ("Is water wet? Answer as JSON.", _obj({"answer": {"type": "boolean"}})),
    ("Pick a fruit, as JSON.", _obj({"fruit": {"enum": ["apple", "banana", "cherry"]}})),
    ("List three colors as JSON.", _obj({"colors": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}})),
    ("A point on a plane, as JSON.", _obj({"x": {"type": "number"}, "y": {"type": "number"}})),
    ("A user with an address, as JSON.", _obj({"user": S, "address": _obj({"street": S, "zip": S})})),
    ("A product with a price, as JSON.", _obj({"name": S, "price": {"type": "number"},
                                               "in_stock": {"type": "boolean"}})),
    ("A weather report, as JSON.", _obj({"city": S, "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                                         "celsius": {"type": "integer"}})),
    ("A to-do item, as JSON.", _obj({"task": S, "done": {"type": "boolean"},
                                     "priority": {"enum": ["low", "medium", "high"]}})),
    ("A movie as JSON.", _obj({"title": S, "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action"]},
                                                      "maxItems": 2}})),
    ("An animal as JSON.", _obj({"species": S, "legs": {"type": "integer"}, "can_fly": {"type": "boolean"}})),
    ("A meeting as JSON.", _obj({"topic": S, "people": {"type": "array", "items": _obj({"name": S}), "maxItems": 2}})),
    ("A car as JSON.", _obj({"make": S, "model": S, "electric": {"type": "boolean"}})),
    ("A recipe as JSON.", _obj({"dish": S, "steps": {"type": "array", "items": S, "maxItems": 2}})),
    ("A score as JSON.", _obj({"home": {"type": "integer"}, "away": {"type": "integer"}})),
    ("A language as JSON.", _obj({"name": S, "typed": {"enum": ["static", "dynamic"]}})),
    ("A planet as JSON.", _obj({"name": S, "moons": {"type": "integer"}, "rings": {"type": "boolean"}})),
    ("A team as JSON.", _obj({"team": S, "lead": _obj({"name": S, "role": {"enum": ["dev", "ops"]}})})),
    # optional, the strict way (OpenAI's rule: every property required, an optional one nullable)
    ("A song as JSON, the year optional.", _obj({"title": S, "year": {"type": ["integer", "null"]}})),
]


@pytest.fixture(scope="module")
def smol_server(smollm2_dir, workers, tmp_path_factory):
    path = write_run_config(tmp_path_factory.mktemp("structured") / "ring3.yaml", smollm2_dir, workers[:2],
                            layers=[10, 10, 10], worker_name="board%d",
                            runtime={"threads": 1, "ring_timeout": 60},
                            serve={"max_in_flight": 4, "model_name": "smol"})
    srv = ServeProcess(path)
    try:
        yield srv.wait_ready(timeout=300)
    finally:
        assert srv.stop() == 0, srv.output()


def _client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(server, body):
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    return r.status_code, r.json()


def _format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


# --- the compiler, on each tokenizer kind ------------------------------------------------------

@pytest.fixture(scope="module")
def smol_compiler(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    return tok, GrammarCompiler(tok, tok.vocab_size)


def test_a_valid_text_s_tokens_are_always_allowed_and_the_end_is_complete(smol_compiler):
    tok, compiler = smol_compiler
    c = compiler.compile(GrammarSpec("json_schema", json.dumps(PERSON), "response_format"))
    text = '{"name": "Ada", "age": 36, "color": "green"}'
    for t in tok.encode_plain(text):
        assert bool(c.allowed()[t]), tok.decode([t])
        assert not c.complete
        assert c.take(t)
    assert c.complete
    assert np.flatnonzero(c.allowed()).tolist() == sorted(tok.end_ids)  # only an end token may follow


def test_json_object_takes_any_object_and_ends_with_it(smol_compiler):
    tok, compiler = smol_compiler
    c = compiler.compile(GrammarSpec("json_object", "", "response_format"))
    assert not bool(c.allowed()[tok.encode_plain("[")[0]])
    for t in tok.encode_plain('{"a": [1, {"b": null}], "c": "d"}'):
        assert bool(c.allowed()[t]) and c.take(t)
    assert c.complete


def test_the_mask_refuses_what_breaks_the_schema(smol_compiler):
    tok, compiler = smol_compiler
    c = compiler.compile(GrammarSpec("json_schema", json.dumps(PERSON), "response_format"))
    allowed = c.allowed()
    for text in ("Sure", " {", "[", '"name"', "\n"):
        assert not bool(allowed[tok.encode_plain(text)[0]]), text
    for t in tok.encode_plain('{"name": "Bo", "age": 7, "color": "'):
        assert c.take(t)
    allowed = c.allowed()
    assert bool(allowed[tok.encode_plain("red")[0]]) and not bool(allowed[tok.encode_plain("purple")[0]])
    fresh = c.fresh()  # another choice of the same request starts from the grammar's start
    assert np.array_equal(fresh.allowed(), compiler.compile(GrammarSpec("json_schema", json.dumps(PERSON), "f")).allowed())
    assert not np.array_equal(fresh.allowed(), allowed)


@pytest.mark.parametrize("kind,text,match", [
    ("json_schema", '{"type": "foo"}', "foo"),
    ("json_schema", "{not json", ""),
    ("gbnf", 'root ::= "a" | (', ""),
    ("gbnf", 'root ::= missing', "missing"),
    ("regex", "[0-9", "regex"),
    ("lark", "start: @@", ""),
])
def test_a_grammar_that_does_not_compile_names_its_field(smol_compiler, kind, text, match):
    _, compiler = smol_compiler
    with pytest.raises(ConstraintError) as e:
        compiler.compile(GrammarSpec(kind, text, "the_field"))
    assert e.value.field == "the_field" and match in str(e.value) and "\n" not in str(e.value)


# Constraints no string satisfies (issue 58, 2): each kind's empty language, found before admission.
# A schema whose required property is the whole schema again: llguidance finds it only after `{"`.
DEAD_END = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
EMPTY = [("gbnf", 'root ::= root "a"', "grammar"), ("gbnf", 'root ::= x\nx ::= "b" y\ny ::= y x', "grammar"),
         ("gbnf", 'root ::= "a" x\nx ::= x "b"', "grammar"), ("gbnf", 'root ::= x{2,3}\nx ::= "a" x', "grammar"),
         ("json_schema", json.dumps({"$ref": "#"}), "json_schema"),
         ("json_schema", json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "json_schema"),
         ("regex", r"[^\s\S]", "regex"), ("regex", r"(a|b)[^\d\D]", "regex")]


@pytest.mark.parametrize("kind,text,field", EMPTY)
def test_a_grammar_no_text_satisfies_is_refused_naming_its_field(smol_compiler, kind, text, field):
    _, compiler = smol_compiler
    with pytest.raises(ConstraintError) as e:
        compiler.compile(GrammarSpec(kind, text, field))
    assert e.value.field == field and "no text satisfies it" in str(e.value) and "\n" not in str(e.value)


def test_an_output_nothing_valid_continues_is_neither_accepting_nor_complete(smol_compiler, monkeypatch):
    """A grammar whose start is fine but whose rest is empty: after `{"` the matcher is dead,
    may only end (llguidance's way), and the output is not whole. The compile's walk past the
    start finds this one (refused); off, it stands for a dead end past the walk's reach."""
    from mdi.model.constraints import constraint
    tok, compiler = smol_compiler
    with pytest.raises(ConstraintError, match="llguidance cannot run it"):
        compiler.compile(GrammarSpec("json_schema", json.dumps(DEAD_END), "json_schema"))
    monkeypatch.setattr(constraint, "PROBE_TOKENS", 0)
    c = compiler.compile(GrammarSpec("json_schema", json.dumps(DEAD_END), "json_schema"))
    first = np.flatnonzero(c.allowed()).tolist()
    assert [tok.decode([t]) for t in first] == ['{"']
    assert not c.take(first[0]) or c.dead(c.allowed())
    assert not c.accepting and not c.complete and c.error and "\n" not in c.error
    a = tok.encode_plain("a")
    ok = compiler.compile(GrammarSpec("regex", "a", "regex"))
    assert ok.take(a[0]) and ok.accepting and ok.complete


@pytest.mark.parametrize("kind,text", [("regex", "a{100000}"), ("regex", "((a{100}){100}){10}"), ("regex", "x{1001,}"),
                                       ("json_schema", json.dumps({"items": {"pattern": "^(ab){5000}$"}})),
                                       ("json_schema", json.dumps({"patternProperties": {"^k{9999}$": {}}})),
                                       ("gbnf", 'root ::= [a-z]{1,5000}'), ("lark", 'start: ("a" "b"){2000}'),
                                       # each count under the cap, the copies they add over it (h34: 60 such
                                       # counts made every user's token 20x slower)
                                       ("regex", "x{999}y" * 11), ("regex", "(x{999}y){11}"),
                                       ("json_schema", json.dumps({"properties": {"a": {"pattern": "a{999}" * 6},
                                                                                  "b": {"pattern": "b{999}" * 6}}}))])
def test_counted_repetitions_past_the_cap_are_refused_naming_the_field(smol_compiler, kind, text):
    _, compiler = smol_compiler
    with pytest.raises(ConstraintError) as e:
        compiler.compile(GrammarSpec(kind, text, "the_field"))
    assert e.value.field == "the_field" and "counted repetition" in str(e.value) and "\n" not in str(e.value)


def test_counted_repetitions_within_the_cap_and_braces_in_data_compile(smol_compiler):
    _, compiler = smol_compiler
    for kind, text in [("regex", "[0-9]{3}-[0-9]{4}"), ("regex", "(a|b){1000}"), ("regex", r"\{5000\}"),
                       ("regex", "x{999}y" * 9), ("regex", "(%s){3}" % "|".join("w%d" % i for i in range(5000))),
                       ("json_schema", json.dumps({"enum": ["a{5000}"], "description": "x{9999}"})),
                       ("gbnf", 'root ::= "{9999}" [a-z]{1,10}')]:
        compiler.compile(GrammarSpec(kind, text, "f"))


def test_a_mask_over_the_budget_is_refused_naming_the_field(smol_compiler):
    """The timed probe: one mask past the start, against the compiler's budget (0 here, so any
    grammar is over it: the refusal is tested, not a timing)."""
    import copy
    _, compiler = smol_compiler
    strict = copy.copy(compiler)
    strict.mask_budget_s = 0.0
    with pytest.raises(ConstraintError) as e:
        strict.compile(GrammarSpec("regex", "[a-z]+", "regex"))
    assert e.value.field == "regex" and "token mask takes" in str(e.value) and "\n" not in str(e.value)
    compiler.compile(GrammarSpec("regex", "[a-z]+", "regex"))  # the default budget: typical masks take < 1 ms


def test_a_request_s_choices_are_charged_together_against_the_mask_budget(smol_compiler, monkeypatch):
    """Every choice computes its own mask each step, so n of them cost n probed masks (h34: four
    masks of 15 ms, each under the budget, slowed every user's token 20x). The probe's time is
    fixed here: the charge is tested, not a timing."""
    import copy
    _, compiler = smol_compiler
    priced = copy.copy(compiler)
    monkeypatch.setattr(priced, "_probe", lambda constraint, first: priced.mask_budget_s / 3.5)
    priced.compile(GrammarSpec("regex", "[a-z]+", "regex"), choices=3)
    with pytest.raises(ConstraintError) as e:
        priced.compile(GrammarSpec("regex", "[a-z]+", "regex"), choices=4)
    assert e.value.field == "regex" and "(4 samples: " in str(e.value) and "\n" not in str(e.value)


def test_a_mask_past_the_deadline_ends_its_sample_in_one_line(smol_compiler):
    """During generation every mask is held to the compiler's deadline (0 here, so any mask is
    past it: the ending is tested, not a timing); the admission's own masks are not."""
    import copy

    from mdi.model.sampling import SamplingError
    _, compiler = smol_compiler
    strict = copy.copy(compiler)
    strict.mask_deadline_s = 0.0
    constraint = strict.compile(GrammarSpec("regex", "[a-z]+", "regex"))
    token = int(np.flatnonzero(constraint.allowed())[0])  # the start's mask, computed at admission
    assert constraint.take(token)
    for _ in range(2):  # and it stays ended
        with pytest.raises(SamplingError) as e:
            constraint.allowed()
        message = str(e.value)
        assert "regex" in message and "serve.mask_deadline_ms" in message and "\n" not in message, message
    with pytest.raises(SamplingError):
        constraint.fresh().allowed()  # another choice's masks too
    relaxed = compiler.compile(GrammarSpec("regex", "[a-z]+", "regex"))  # the default deadline
    assert relaxed.take(token) and relaxed.allowed().any()


class _Matcher:
    """llguidance's matcher as a Constraint calls it, each mask costing the CPU seconds listed."""

    def __init__(self, costs):
        self.costs = list(costs)

    def compute_bitmask(self):
        import time
        t0, cost = time.thread_time(), self.costs.pop(0)
        while time.thread_time() - t0 < cost:  # CPU time, however busy the machine
            pass
        return bytes(4)

    def consume_token(self, token):
        return True

    def is_error(self):
        return False


@pytest.mark.parametrize("costs, ended_at", [
    ([0.015] + [0] * 64 + [0.015, 0], None),  # now and then a mask past the deadline: let go
    ([0, 0.015, 0.015, 0], 2),                # two in a row: the grammar
    ([0.015, 0, 0, 0.015, 0], 3),             # two close together (a slow mask every other one...)
    ([0, 0.045, 0], 1),                       # far past it: at once
])
def test_a_mask_past_the_deadline_once_is_let_go_and_again_ends_the_sample(costs, ended_at):
    """One mask in 4,767 of a plain tool call took 99 ms of CPU (50 allowed) once, on a busy
    machine, and its request failed with a 503."""
    from mdi.model.constraints.constraint import Constraint
    from mdi.model.sampling import SamplingError
    spec = GrammarSpec("regex", "[a-z]+", "regex")
    constraint = Constraint(lambda: None, _Matcher(costs), 32, 32, spec, deadline_s=0.01)
    for i in range(len(costs)):
        if i == ended_at:
            with pytest.raises(SamplingError, match="token mask took"):
                constraint.allowed()
            return
        constraint.allowed()
        assert constraint.take(0)
    assert ended_at is None


@pytest.mark.parametrize("value", [0, -5, "50", float("inf"), True])
def test_a_mask_deadline_that_is_not_a_positive_time_is_a_config_error(value):
    from mdi.runconfig import ConfigError, parse_config
    with pytest.raises(ConfigError) as e:
        parse_config({"model": {"path": "models/none"}, "serve": {"mask_deadline_ms": value}}, "s.yaml")
    assert "s.yaml" in str(e.value) and "mask_deadline_ms" in str(e.value)
    cfg = parse_config({"model": {"path": "models/none"}, "serve": {"mask_deadline_ms": 7.5}}, "s.yaml")
    assert cfg.serve.mask_deadline_ms == 7.5


def test_a_sample_past_the_mask_deadline_ends_and_the_others_go_on(tmp_path):
    """A server whose mask deadline every mask misses: constrained requests end with an error
    naming their grammar (never a "stop"), whole or streamed; a free request beside them gets
    the text it gets alone; the server serves on."""
    from test_serve import tiny_serve_net
    from conftest import CHARS
    net = tiny_serve_net()
    model = str(tmp_path / "tiny")
    save_test_model(model, net.config, net.state_dict(), "tests/test_structured_outputs.py")
    char_tokenizer(CHARS).save(model)
    path = write_run_config(tmp_path / "one.yaml", model, runtime={"threads": 1},
                            serve={"max_in_flight": 4, "mask_deadline_ms": 1e-6})
    srv = ServeProcess(path)
    try:
        srv.wait_ready()
        free = {"prompt": "abc", "max_tokens": 12, "temperature": 0}
        alone = requests.post(srv.url + "/v1/completions", json=free, timeout=120).json()["choices"][0]["text"]
        # the grammar tables (memory in proportion to the vocabulary) are built at the first grammar only
        assert "constrained decoding ready" not in srv.output()
        results = {}

        def run(name, body):
            results[name] = requests.post(srv.url + "/v1/completions", json=body, timeout=120)

        bodies = {"free": free, "regex": dict(free, regex="[a-z]{1,40}"),
                  "schema": dict(free, json_schema={"type": "string", "maxLength": 30})}
        threads = [threading.Thread(target=run, args=item) for item in bodies.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["free"].status_code == 200 and results["free"].json()["choices"][0]["text"] == alone
        for name in ("regex", "schema"):
            r = results[name]
            assert r.status_code != 200 and "mask_deadline_ms" in r.json()["error"]["message"], r.text
        assert srv.output().count("constrained decoding ready") == 1  # two grammars at once, built once
        with requests.post(srv.url + "/v1/completions", json=dict(bodies["regex"], stream=True), stream=True,
                           timeout=120) as r:
            lines = [line for line in r.iter_lines() if line.startswith(b"data: ")]
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert lines[-1] == b"data: [DONE]" and "mask_deadline_ms" in events[-1]["error"]["message"], events
        assert not any(c.get("finish_reason") == "stop" for e in events for c in e.get("choices", [])), events
        again = requests.post(srv.url + "/v1/completions", json=free, timeout=120)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == alone
    finally:
        assert srv.stop() == 0, srv.output()


@pytest.mark.parametrize("make", [gpt2_tokenizer, lambda: char_tokenizer(list("abcdefghij0123456789 {}\":,\n"))],
                         ids=["gpt2", "char"])
def test_other_tokenizer_kinds_compile_and_constrain(make):
    tok = make()
    compiler = GrammarCompiler(tok, tok.vocab_size + 7)  # a head padded past the vocabulary
    c = compiler.compile(GrammarSpec("regex", "[0-9]{2}", "regex"))
    allowed = c.allowed()
    assert allowed.shape == (tok.vocab_size + 7,) and not bool(allowed[tok.vocab_size:].any())
    for t in tok.encode_plain("42"):
        assert bool(c.allowed()[t]) and c.take(t)
    assert c.complete
    assert not bool(c.allowed()[tok.encode_plain("7")[0]])


# --- the server ---------------------------------------------------------------------------------

def test_twenty_json_schemas_are_obeyed_streamed_and_whole(smol_server):
    client = _client(smol_server)
    failures = []

    def one(i, prompt, schema):
        try:
            kwargs = dict(model="smol", messages=[{"role": "user", "content": prompt}], temperature=0,
                          max_tokens=160, response_format=_format(schema))
            if i % 2:
                chunks = list(client.chat.completions.create(stream=True, **kwargs))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                assert finish == ["stop"], finish
            else:
                answer = client.chat.completions.create(**kwargs)
                text = answer.choices[0].message.content
                assert answer.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(text), schema)
        except Exception as e:  # collected: one thread's failure must not hide the others'
            failures.append("%d %r: %s" % (i, prompt, e))

    threads = [threading.Thread(target=one, args=(i, p, s)) for i, (p, s) in enumerate(SCHEMAS)]
    for batch in (threads[:4], threads[4:8], threads[8:12], threads[12:16], threads[16:]):
        for t in batch:
            t.start()
        for t in batch:
            t.join()
    assert not failures, failures


def test_gbnf_grammar_regex_and_json_object_are_obeyed_on_both_routes(smol_server):
    gbnf = 'root ::= answer " because " [a-z ]{1,30}\nanswer ::= "yes" | "no"'
    status, body = _chat(smol_server, {"messages": [{"role": "user", "content": "Is the sky blue?"}],
                                       "temperature": 0, "max_tokens": 40, "grammar": gbnf})
    assert status == 200, body
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,30}", body["choices"][0]["message"]["content"])
    r = requests.post(smol_server.url + "/v1/completions", json={
        "prompt": "My phone number is", "max_tokens": 20, "temperature": 0.9, "seed": 5,
        "regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"}, timeout=300)
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", r.json()["choices"][0]["text"])
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    # json_object leaves keys and lengths to the model: a 135M model may write until max_tokens
    status, body = _chat(smol_server, {"messages": [{"role": "user", "content": "Your name and age as JSON."}],
                                       "temperature": 0, "max_tokens": 60,
                                       "response_format": {"type": "json_object"}})
    assert status == 200, body
    text = body["choices"][0]["message"]["content"]
    assert text.startswith('{"')
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    status, body = _chat(smol_server, {"messages": [{"role": "user", "content": "Pick."}], "temperature": 0,
                                       "max_tokens": 10, "json_schema": {"enum": ["left", "right"]}})
    assert status == 200 and json.loads(body["choices"][0]["message"]["content"]) in ("left", "right"), body


def test_constrained_and_free_requests_share_the_ring_and_free_text_is_unchanged(smol_server):
    free = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0,
            "max_tokens": 24, "cache_prompt": False}
    alone = _chat(smol_server, free)[1]["choices"][0]["message"]["content"]
    results = {}

    def run(name, body):
        results[name] = _chat(smol_server, body)

    bodies = {"free": free, "n": {"messages": [{"role": "user", "content": "A person as JSON."}], "n": 2,
                                  "temperature": 0.8, "seed": 3, "max_tokens": 120,
                                  "response_format": _format(PERSON)},
              "spec": {"messages": [{"role": "user", "content": "A person as JSON."}], "temperature": 0,
                       "max_tokens": 120, "speculation": "ngram", "response_format": _format(PERSON)}}
    threads = [threading.Thread(target=run, args=item) for item in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["free"][1]["choices"][0]["message"]["content"] == alone
    assert results["n"][0] == 200 and len(results["n"][1]["choices"]) == 2
    for choice in results["n"][1]["choices"] + results["spec"][1]["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    plain = _chat(smol_server, dict(bodies["spec"], speculation="off"))[1]
    assert plain["choices"][0]["message"]["content"] == results["spec"][1]["choices"][0]["message"]["content"]
    metrics = requests.get(smol_server.url + "/metrics", timeout=30).text
    masks = float(re.search(r"^mdi_grammar_masks_total (\S+)$", metrics, re.M).group(1))
    assert masks >= sum(results[k][1]["usage"]["completion_tokens"] for k in ("n", "spec"))  # one per drawn token


@pytest.mark.parametrize("field,value,says", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "foo"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
    ("response_format", {"type": "json_schema"}, "json_schema"),
    ("response_format", {"type": "xml"}, "expected"),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "strict": "yes"}},
     "strict"),
    ("grammar", 'root ::= "a" (', ""),
    ("grammar", 7, "string"),
    ("regex", "(unclosed", "regex"),
    ("json_schema", {"type": "object", "properties": {"a": {"type": "nope"}}}, "nope"),
    ("regex", "a{100000}", "counted repetition"),  # issue 58 (1): its masks would slow every user
    ("regex", "(a{1000}){100}", "counted repetition"),
    ("json_schema", {"type": "string", "pattern": "^a{100000}$"}, "counted repetition"),
    ("response_format", _format(_obj({"a": {"type": "string", "pattern": "b{2000}"}})), "counted repetition"),
    ("grammar", 'root ::= ("a"{100}){100}', "counted repetition"),
    ("regex", "x{999}y" * 11, "copies in all"),
    # bounds llguidance reads as doubles: past 2^53 - 1 an answer it allowed broke the schema (h34)
    ("response_format", _format(_obj({"id": {"type": "integer", "minimum": 2 ** 53 + 1}})), "not a double"),
    ("json_schema", {"type": "integer", "minimum": 1e300, "maximum": 1e301}, "past int64"),
    ("json_schema", {"type": "integer", "minimum": 10 ** 17, "multipleOf": 7}, "beside multipleOf"),
    # counted repetitions where the counts once did not look: a property named like a data keyword
    ("response_format", _format(_obj({"enum": {"type": "string", "pattern": "x{999}y" * 11}})), "copies in all"),
    ("tools", [{"type": "function", "function": {"name": "get", "parameters": _obj(
        {"id": {"type": "integer", "exclusiveMinimum": 2 ** 53}})}}], "function 'get''s parameters: exclusiveMin"),
    # strict as OpenAI means it: every object closed, every property required (strict_schema)
    ("response_format", _format({"allOf": [{"type": "object", "properties": {"emp_id": {"type": "integer"}},
                                            "required": ["emp_id"]}]}),
     '"additionalProperties": false on every object, not at #/allOf/0'),
    ("response_format", _format(_obj({"user": S, "address": dict(_obj({"street": S, "zip": S}), required=["zip"])})),
     '"required"'),
    ("response_format", _format({"type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"],
                                 "additionalProperties": False, "$defs": {"p": {"type": "object"}}}),
     "at #/$defs/p"),
])
def test_bad_shapes_are_one_400_naming_the_field(smol_server, field, value, says):
    status, body = _chat(smol_server, {"messages": [{"role": "user", "content": "x"}], field: value})
    assert status == 400, body
    assert body["error"]["param"] == field and says in body["error"]["message"], body


def test_constraints_no_text_satisfies_are_400s_and_a_dead_end_is_never_a_stop(smol_server):
    fields = {"gbnf": "grammar", "regex": "regex"}
    for kind, text, _ in EMPTY:
        field = fields.get(kind, "json_schema")
        value = json.loads(text) if kind == "json_schema" else text
        for route, body in (("/v1/completions", {"prompt": "x"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = requests.post(smol_server.url + route, json=dict(body, **{field: value}), timeout=300)
            assert r.status_code == 400, (text, r.text)
            assert r.json()["error"]["param"] == field and "no text satisfies" in r.json()["error"]["message"]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
    status, body = _chat(smol_server, {"messages": [{"role": "user", "content": "x"}], "response_format": schema})
    assert status == 400 and body["error"]["param"] == "response_format", body
    # its start is fine, its rest is empty: the answer "a" is not one it accepts, so it is no "stop".
    # The compile's walk past the start may find it (llguidance's item limit: a 400 naming the
    # field); else the sample fails in the ring, naming its grammar.
    dead_end = {"prompt": "x", "max_tokens": 8, "temperature": 0, "json_schema": DEAD_END}
    r = requests.post(smol_server.url + "/v1/completions", json=dead_end, timeout=300)
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] != "stop", r.text
    assert r.status_code != 200 and ("grammar" in r.json()["error"]["message"]
                                     or r.json()["error"]["param"] == "json_schema"), r.text
    with requests.post(smol_server.url + "/v1/completions", json=dict(dead_end, stream=True), stream=True,
                       timeout=300) as r:
        if r.status_code == 400:
            assert r.json()["error"]["param"] == "json_schema", r.text
            return
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith(b"data: ") and line != b"data: [DONE]"]
    assert "error" in events[-1] and not any(c.get("finish_reason") == "stop" for e in events
                                              for c in e.get("choices", [])), events


def test_two_shapes_at_once_are_refused(smol_server):
    status, body = _chat(smol_server, {"messages": [{"role": "user", "content": "x"}], "regex": "a",
                                       "grammar": 'root ::= "a"'})
    assert status == 400 and "only one of" in body["error"]["message"], body


def test_without_llguidance_the_server_says_so_once_and_refuses_the_fields(tmp_path):
    """Python 3.8 (JetPack 5) has no llguidance wheel: one line at start, then a 400 for every
    constrained request (never unconstrained text), and free requests served as ever."""
    import os
    import sys

    from test_serve import tiny_serve_net
    from conftest import CHARS
    net = tiny_serve_net()
    model = str(tmp_path / "tiny")
    save_test_model(model, net.config, net.state_dict(), "tests/test_structured_outputs.py")
    char_tokenizer(CHARS).save(model)
    shadow = tmp_path / "shadow" / "llguidance"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("no llguidance wheel for this Python")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow.parent)] + sys.path))
    path = write_run_config(tmp_path / "one.yaml", model, runtime={"threads": 1}, serve={"max_in_flight": 2})
    srv = ServeProcess(path, env=env)
    try:
        srv.wait_ready()
        for field, value in (("response_format", {"type": "json_object"}), ("grammar", 'root ::= "a"'),
                             ("regex", "a+"), ("json_schema", {"type": "string"})):
            r = requests.post(srv.url + "/v1/completions", json={"prompt": "ab", field: value}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert "llguidance" in r.json()["error"]["message"]
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0, srv.output()
    said = [line for line in srv.output().splitlines() if "structured outputs" in line]
    assert len(said) == 1 and "no llguidance wheel" in said[0], srv.output()


def test_bad_shapes_leave_a_request_in_flight_unchanged(smol_server):
    body = {"messages": [{"role": "user", "content": "Name three rivers."}], "temperature": 0, "max_tokens": 40,
            "cache_prompt": False}
    alone = _chat(smol_server, body)[1]["choices"][0]["message"]["content"]
    result = {}
    streaming = threading.Thread(target=lambda: result.update(answer=_chat(smol_server, body)))
    streaming.start()
    for bad in ({"grammar": 'root ::= ('}, {"regex": "(("}, {"json_schema": {"type": "nope"}},
                {"response_format": {"type": "json_schema", "json_schema": {"schema": {"minimum": "x"}}}}):
        status, _ = _chat(smol_server, dict({"messages": [{"role": "user", "content": "x"}]}, **bad))
        assert status == 400
    streaming.join()
    assert result["answer"][0] == 200 and result["answer"][1]["choices"][0]["message"]["content"] == alone


def test_keywords_the_decoder_cannot_enforce_are_refused_when_strict_and_ignored_when_not(smol_compiler):
    _, compiler = smol_compiler
    schema = json.dumps({"type": "array", "items": {"type": "string"}, "uniqueItems": True})
    with pytest.raises(ConstraintError) as e:
        compiler.compile(GrammarSpec("json_schema", schema, "response_format"))  # strict by default
    assert "uniqueItems" in str(e.value) and "strict false" in str(e.value)
    compiler.compile(GrammarSpec("json_schema", schema, "response_format", strict=False))
    # the request fields: strict json_schema refuses, non-strict (OpenAI's default) and llama.cpp's accept
    from mdi.serving.validation import COMPLETIONS, parse_options
    from mdi.model.sampling import SamplingParams
    strict = {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(schema), "strict": True}}
    for body, want in (({"response_format": strict}, True),
                       ({"response_format": dict(strict, json_schema=dict(strict["json_schema"], strict=False))},
                        False),
                       ({"json_schema": json.loads(schema)}, False)):
        opts, _ = parse_options(dict(body, prompt="a"), COMPLETIONS, SamplingParams())
        assert opts.grammar.strict is want


def test_openai_s_strict_rule_holds_for_strict_schemas_only():
    from mdi.serving.validation import CHAT, ApiError, parse_options
    from mdi.model.sampling import SamplingParams
    loose = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": loose}}
    body = {"messages": [{"role": "user", "content": "x"}]}
    for strict in (False, None):  # OpenAI's default is not strict: plain JSON Schema
        opts, _ = parse_options(dict(body, response_format=dict(fmt, json_schema=dict(fmt["json_schema"],
                                                                                      strict=strict))),
                                CHAT, SamplingParams())
        assert opts.grammar is not None and not opts.grammar.strict
    with pytest.raises(ApiError) as e:
        parse_options(dict(body, response_format=_format(loose)), CHAT, SamplingParams())
    assert e.value.param == "response_format" and "additionalProperties" in e.value.message
    closed = dict(loose, additionalProperties=False)
    with pytest.raises(ApiError) as e:
        parse_options(dict(body, response_format=_format(closed)), CHAT, SamplingParams())
    assert "b is not, at #" in e.value.message
    opts, _ = parse_options(dict(body, response_format=_format(dict(closed, required=["a", "b"]))), CHAT,
                            SamplingParams())
    assert opts.grammar.strict


def _takes(compiler, tok, schema, text):
    """Whether the compiled schema takes `text` whole, token by token (SmolLM2's tokens)."""
    c = compiler.compile(GrammarSpec("json_schema", json.dumps(schema), "response_format"))
    for t in tok.encode_plain(text):
        if not bool(c.allowed()[t]) or not c.take(t):
            return False
    return c.complete


RUNS = _obj({"n": {"type": "integer"}, "x": {"type": "number"}, "at": {"type": "string", "format": "time"},
             "when": {"type": "string", "format": "date-time"}, "took": {"type": "string", "format": "duration"}})


@pytest.mark.parametrize("key, fine, too_long", [
    ("n", "123456789012345", "1234567890123456"),  # 15 integer digits at most
    ("x", "-12.123456789", "0.1234567891"),  # 9 fraction digits
    ("at", '"10:10:10.123456Z"', '"10:10:10.1234567Z"'),  # microseconds
    ("when", '"2024-05-01T10:10:10.5+02:00"', '"2024-05-01T10:10:10.0000000Z"'),
    ("took", '"P1DT2H"', '"P1234567890D"'),
])
def test_number_and_format_runs_are_bounded_by_default(smol_compiler, key, fine, too_long):
    tok, compiler = smol_compiler
    schema = dict(RUNS, required=[key], properties={key: RUNS["properties"][key]})
    assert _takes(compiler, tok, schema, '{"%s": %s}' % (key, fine))
    assert not _takes(compiler, tok, schema, '{"%s": %s}' % (key, too_long))
    # a schema's own x-mdi-bounds overrides the default (0: unbounded)
    opened = dict(schema, **{"x-mdi-bounds": {"integer_digits": 0, "fraction_digits": 0, "time_fraction_digits": 0}})
    assert _takes(compiler, tok, opened, '{"%s": %s}' % (key, too_long)) is (key != "took")


def test_integer_bounds_llguidance_holds_as_doubles_are_enforced_exactly(smol_compiler):
    tok, compiler = smol_compiler
    top = 2 ** 53 - 1
    schema = _obj({"id": {"type": "integer", "exclusiveMinimum": top - 2, "maximum": top}})
    assert _takes(compiler, tok, schema, '{"id": %d}' % top)
    assert not _takes(compiler, tok, schema, '{"id": %d}' % (top - 2))
    assert not _takes(compiler, tok, schema, '{"id": %d}' % (top + 1))
    # past 2^53, bounds that are doubles exactly hold (h35: refusing every one of them refused 1e18)
    big = _obj({"id": {"type": "integer", "minimum": 2 ** 62, "maximum": 2 ** 62}})
    assert _takes(compiler, tok, big, '{"id": %d}' % 2 ** 62)
    assert not _takes(compiler, tok, big, '{"id": %d}' % (2 ** 62 + 1))


def test_counted_repetitions_are_counted_in_embedded_schemas_and_keyword_named_properties():
    from mdi.model.constraints.grammar_cost import spec_repeat
    heavy = {"type": "string", "pattern": "x{999}y" * 11}
    lark = 'start: "a" | %json ' + json.dumps(_obj({"q": heavy})) + "\n"
    assert spec_repeat("lark", lark).added > 10000  # inside quotes, the text alone showed none
    for name in ("enum", "const", "default", "examples"):
        assert spec_repeat("json_schema", json.dumps(_obj({name: heavy}))).added > 10000, name
    assert spec_repeat("json_schema", json.dumps({"enum": ["x{999}y" * 11]})).added == 0  # data, not a pattern


def test_a_response_format_inside_the_calls_grammar_is_costed_as_itself(smol_server):
    heavy = _format(_obj({"q": {"type": "string", "pattern": "x{999}y" * 11}}))
    tools = [{"type": "function", "function": {"name": "get", "parameters": _obj({"id": {"type": "integer"}})}}]
    status, body = _chat(smol_server, {"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                       "response_format": heavy})
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert "copies in all" in body["error"]["message"], body


def test_time_and_duration_answers_end_valid(smol_server):
    schema = _obj({"time": {"type": "string", "format": "time"}, "took": {"type": "string", "format": "duration"},
                   "count": {"type": "integer"}})
    for prompt in ("When did the meeting start, how long did it take, and how many came? As JSON.",
                   "The time of the last train, its journey's length and its number of cars, as JSON."):
        status, body = _chat(smol_server, {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                                           "max_tokens": 120, "response_format": _format(schema)})
        choice = body["choices"][0]
        assert status == 200 and choice["finish_reason"] == "stop", body
        answer = json.loads(choice["message"]["content"])
        jsonschema.validate(answer, schema)  # RFC 3339's forms below (jsonschema's checker wants more packages)
        assert re.fullmatch(r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]{1,6})?([Zz]|[+-][0-9:]{5})",
                            answer["time"]), answer
        assert re.fullmatch(r"P(?=.)([0-9]+[YMWD])*(T(?=.)([0-9]+[HMS])*)?", answer["took"]), answer


# A grammar that compiles but cannot run (issue 58, 6): llguidance refuses a parser row of more
# than 2000 items, here past the first token. Found at admission: a 400 with its own message.
WIDE = "root ::= " + " | ".join('"w%d"' % i for i in range(10000))


@pytest.mark.parametrize("text", [WIDE, 'root ::= "abc xyz" (' + WIDE[len("root ::= "):] + ")"], ids=["start", "later"])
def test_a_grammar_llguidance_cannot_run_is_refused_with_its_message(smol_compiler, text):
    _, compiler = smol_compiler
    with pytest.raises(ConstraintError) as e:
        compiler.compile(GrammarSpec("gbnf", text, "grammar"))
    message = str(e.value)
    assert e.value.field == "grammar" and "max is 2000" in message, message
    assert "\n" not in message and "<state>" not in message and "w9999" not in message, message


def test_a_grammar_too_wide_to_run_is_a_400_naming_grammar(smol_server):
    for route, body in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = requests.post(smol_server.url + route, json=dict(body, grammar=WIDE, max_tokens=4), timeout=300)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "grammar" and "items" in error["message"], error
        assert "\n" not in error["message"] and "<state>" not in error["message"], error


# Rules chained one into the next (r_i ::= "x.." r_{i+1}?), 4,000 of them in 125 KB: llguidance
# follows the chain recursively while it builds the grammar, past a thread's default 8 MB stack,
# which killed the whole server (SIGSEGV); built on a deep stack (mdi.system.deep_stack) it is a 400.
CHAINED = ("root ::= " + " | ".join("r%d" % i for i in range(4000)) + "\n"
           + "\n".join('r%d ::= "%s" r%d?' % (i, "x" * (i % 7 + 1), (i + 1) % 4000) for i in range(4000)))


def test_the_emptiness_check_judges_a_long_chain_of_rules_once_per_rule(monkeypatch):
    """A rule is judged again only when a rule it names turns productive: a chain of 8,300 rules,
    all judged again each round, took 43 s of a server thread (h34)."""
    from mdi.model.constraints import grammar_empty
    judged = []
    real = grammar_empty._derives
    monkeypatch.setattr(grammar_empty, "_derives", lambda body, productive: judged.append(1) or real(body, productive))
    n = 3000
    chain = "start: r0\n" + "".join("r%d: r%d\n" % (i, i + 1) for i in range(n)) + 'r%d: "z"\n' % n
    # (every call counts: a rule's body is 3 nested parts here, and _derives recurses into each)
    assert grammar_empty.derives_text(chain) is True
    assert len(judged) <= 3 * 3 * (n + 2), len(judged)
    assert grammar_empty.derives_text(chain.replace('"z"', 'r0 "z"')) is False  # a cycle with no way out


def test_a_grammar_of_thousands_of_chained_rules_is_a_400_and_the_server_lives(smol_server):
    r = requests.post(smol_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "grammar": CHAINED},
                      timeout=300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
    assert requests.get(smol_server.url + "/health", timeout=30).json()["ok"] is True
    r = requests.post(smol_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "grammar":
                                                                'root ::= "ab" | "cd"'}, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("ab", "cd"), r.text


# A tree: each node's children are nodes (a recursive $ref), and a list through a nullable "#".
TREE = {"$defs": {"node": _obj({"name": {"type": "string", "maxLength": 8},
                                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}})},
        "$ref": "#/$defs/node"}
LINKED = _obj({"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}})


def _nested(depth):
    """A tree `depth` nodes deep: a root, then one child under each node."""
    return {"name": "n%d" % depth, "children": [_nested(depth - 1)] if depth > 1 else []}


def _chain(length):
    return {"v": length, "next": _chain(length - 1) if length > 1 else None}


@pytest.mark.parametrize("schema, answer", [(TREE, _nested), (LINKED, _chain)], ids=["tree", "linked"])
def test_recursive_refs_nest_at_most_ref_depth_levels(smol_compiler, schema, answer):
    tok, compiler = smol_compiler
    assert _takes(compiler, tok, schema, json.dumps(answer(6)))  # 6 levels by default
    assert not _takes(compiler, tok, schema, json.dumps(answer(7)))
    jsonschema.validate(answer(7), schema)  # valid, but nested past the cap
    # x-mdi-bounds overrides it (0: unbounded)
    assert _takes(compiler, tok, dict(schema, **{"x-mdi-bounds": {"ref_depth": 2}}), json.dumps(answer(2)))
    assert not _takes(compiler, tok, dict(schema, **{"x-mdi-bounds": {"ref_depth": 2}}), json.dumps(answer(3)))
    assert _takes(compiler, tok, dict(schema, **{"x-mdi-bounds": {"ref_depth": 0}}), json.dumps(answer(12)))


def test_a_recursion_that_cannot_end_is_left_as_it_is():
    from mdi.model.constraints.schema_bounds import bounded
    endless = _obj({"v": {"type": "string", "maxLength": 4}, "next": {"$ref": "#"}})  # a required child
    assert bounded(endless) == endless
    odd = {"$defs": {"n": _obj({"not": {"not": {"$ref": "#/$defs/n"}}}, required=[])}, "$ref": "#/$defs/n"}
    assert bounded(odd) == odd  # a cut through `not`: not reasoned about
    # a tree whose children are optional: the deepest level leaves them out
    optional = {"$defs": {"n": _obj({"name": S, "child": {"$ref": "#/$defs/n"}}, required=["name"])},
                "$ref": "#/$defs/n"}
    deepest = bounded(optional)["$defs"]["n-mdi-5"]
    assert deepest["properties"]["child"] is False and deepest["required"] == ["name"]


def test_a_recursive_schema_s_answers_end_valid(smol_server):
    for prompt in ("A family tree of three generations, as JSON.", "A folder tree of a software project, as JSON."):
        status, body = _chat(smol_server, {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                                           "max_tokens": 400, "response_format": _format(TREE)})
        choice = body["choices"][0]
        assert status == 200 and choice["finish_reason"] == "stop", body
        jsonschema.validate(json.loads(choice["message"]["content"]), TREE)



def test_objects_that_list_their_properties_are_closed_unless_they_say_otherwise(smol_compiler):
    """As llama.cpp's converter: an object schema with `properties` and nothing said of other
    keys takes none (left open, SmolLM2 wrote a call's arguments past its properties, one key
    again and again, until max_tokens); `additionalProperties: true` keeps it open, and allOf's
    parts, each some of one object's properties, stay as they are."""
    from mdi.model.constraints.schema_bounds import bounded
    tok, compiler = smol_compiler
    loose = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                              "pop": {"type": "integer"}}, "required": ["name"]}
    assert bounded(loose)["additionalProperties"] is False and "additionalProperties" not in loose  # a copy
    assert _takes(compiler, tok, loose, '{"name": "Paris", "pop": 2}')
    assert not _takes(compiler, tok, loose, '{"name": "Paris", "country": "FR"}')
    opened = dict(loose, additionalProperties=True)
    assert _takes(compiler, tok, opened, '{"name": "Paris", "country": "FR"}')
    nested = {"type": "object", "properties": {"city": loose}, "required": ["city"]}
    assert not _takes(compiler, tok, nested, '{"city": {"name": "Paris", "x": 1}}')
    parts = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                       {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert _takes(compiler, tok, parts, '{"a": 1, "b": 2}')
    free = {"type": "object"}  # no properties listed: any object, as llama.cpp's
    assert bounded(free) == free and _takes(compiler, tok, free, '{"x": 1}')
