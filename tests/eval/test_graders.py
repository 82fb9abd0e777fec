"""OpenAI-format graders run locally: templates, every grader type and metric, the Python
sandbox (limits, network, crashes, the worker pool), model graders with a plain-function
judge, and the /v1/fine_tuning/alpha/graders routes on a real server through the openai client."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from kiln import graders
from kiln.errors import InvalidRequest
from kiln.graders import templates
from kiln.graders.multi import FormulaError
from kiln.graders.result import FLAGS

MODEL = "tiny-llama"
OUT = "{{ sample.output_text }}"


def check(operation, input=OUT, reference="{{item.answer}}", name="check"):
    return {"type": "string_check", "name": name, "operation": operation, "input": input, "reference": reference}


def similarity(metric, **extra):
    return {"type": "text_similarity", "name": "sim", "evaluation_metric": metric, "input": OUT,
            "reference": "{{ item.reference }}", **extra}


def python(source, name="py"):
    return {"type": "python", "name": name, "source": source}


def invalid(grader) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        graders.validate(grader)
    return info.value


# ---- templates ------------------------------------------------------------------------------


def test_render_paths_values_and_missing():
    sample = graders.make_sample('{"city": "Paris", "n": 3}')
    item = {"answer": "Paris", "refs": ["a", "b"], "meta": {"k": [1, {"x": True}]}, "odd key": "v", "none": None}
    cases = {
        "{{item.answer}}": "Paris", "{{  item.answer  }}": "Paris", "{{item.refs[1]}}": "b", "{{item.refs.0}}": "a",
        "{{ item.meta.k[1].x }}": "true", "{{item.meta}}": '{"k": [1, {"x": true}]}', "{{item['odd key']}}": "v",
        '{{item["odd key"]}}': "v", "{{item.none}}": "null", "{{sample.output_json.city}}": "Paris",
        "{{sample.output_json.n}}": "3", "{{sample.choices[0].message.content}}": sample["output_text"],
        "{{sample.choices.0.message.role}}": "assistant", "{{item.refs[-1]}}": "b",
        # a path that does not resolve renders empty; text that is not a path stays as written
        "{{item.missing}}": "", "{{item.refs[5]}}": "", "{{item.answer.deeper}}": "", "{{sample.output_json.x.y}}": "",
        '{{"score": 1}}': '{{"score": 1}}', "{{ item.answer | upper }}": "{{ item.answer | upper }}",
        "a {{item.answer}} and {{item.refs[0]}}!": "a Paris and a!",
    }
    for template, expected in cases.items():
        assert templates.render(template, sample, item) == expected, template


def test_make_sample_follows_openai_namespace():
    s = graders.make_sample('{"a": [1, 2]}')
    assert s["output_json"] == {"a": [1, 2]} and s["output_text"] == '{"a": [1, 2]}'
    assert s["choices"][0]["message"] == {"role": "assistant", "content": '{"a": [1, 2]}'}
    assert graders.make_sample("not json")["output_json"] == {}
    assert graders.make_sample("42")["output_json"] == {}  # a bare scalar is no JSON object


def test_unknown_template_namespace_is_refused_naming_the_field():
    err = invalid(check("eq", reference="{{ items.answer }}"))
    assert err.param == "grader.reference" and "items.answer" in err.message
    typo = [{"type": "input_text", "text": "{{ smaple.output_text }}"}]
    err = invalid({"type": "score_model", "name": "j", "model": MODEL, "input": [{"role": "user", "content": typo}]})
    assert err.param == "grader.input[0].content[0].text"


# ---- string_check ---------------------------------------------------------------------------


@pytest.mark.parametrize("operation,output,answer,reward", [
    ("eq", "Paris", "Paris", 1.0), ("eq", "paris", "Paris", 0.0), ("ne", "Lyon", "Paris", 1.0),
    ("ne", "Paris", "Paris", 0.0), ("like", "It is Paris.", "Paris", 1.0), ("like", "It is PARIS.", "Paris", 0.0),
    ("ilike", "It is PARIS.", "paris", 1.0), ("ilike", "It is Lyon.", "paris", 0.0),
])
def test_string_check(operation, output, answer, reward):
    result = graders.build(check(operation)).grade(output, {"answer": answer})
    assert result.reward == reward and not result.errors.any
    assert result.name == "check" and result.type == "string_check" and result.execution_time >= 0


def test_string_check_validation_names_the_field():
    assert invalid(check("contains")).param == "grader.operation"
    assert invalid({k: v for k, v in check("eq").items() if k != "input"}).param == "grader.input"
    assert invalid({k: v for k, v in check("eq").items() if k != "name"}).param == "grader.name"
    assert invalid({**check("eq"), "reference": 3}).param == "grader.reference"
    assert invalid({**check("eq"), "type": "regex"}).param == "grader.type"
    assert invalid({k: v for k, v in check("eq").items() if k != "type"}).param == "grader.type"
    assert invalid("eq").param == "grader"


# ---- text_similarity ------------------------------------------------------------------------

OUTPUT, REFERENCE = "the cat sat on the mat", "the cat is on the mat"


def test_similarity_metrics_match_the_libraries():
    from nltk.tokenize import wordpunct_tokenize
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from nltk.translate.gleu_score import sentence_gleu
    from rapidfuzz import fuzz
    from rouge_score import rouge_scorer

    hyp, ref = wordpunct_tokenize(OUTPUT), wordpunct_tokenize(REFERENCE)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rouge3", "rouge4", "rouge5", "rougeL"])
    rouge = scorer.score(REFERENCE, OUTPUT)
    expected = {"fuzzy_match": fuzz.ratio(OUTPUT, REFERENCE) / 100,
                "bleu": sentence_bleu([ref], hyp, smoothing_function=SmoothingFunction().method1),
                "gleu": sentence_gleu([ref], hyp),
                **{f"rouge_{n}": rouge[f"rouge{n}"].fmeasure for n in (1, 2, 3, 4, 5)},
                "rouge_l": rouge["rougeL"].fmeasure}
    for metric, value in expected.items():
        assert graders.build(similarity(metric)).grade(OUTPUT, {"reference": REFERENCE}).reward == pytest.approx(
            value), metric
    # hand-computed: 5 of 6 unigrams shared -> F = 5/6; bigrams: the cat, on the, the mat of 5 -> 3/5
    assert expected["rouge_1"] == pytest.approx(5 / 6) and expected["rouge_2"] == pytest.approx(3 / 5)
    assert expected["gleu"] == pytest.approx(0.5)  # GLEU: min(precision, recall) of 1-4-grams: 9/18 each


def test_meteor_runs_without_wordnet_exact_and_stem_only():
    from nltk.translate.meteor_score import meteor_score

    class NoSynonyms:
        def synsets(self, word):
            return []

    grade = graders.build(similarity("meteor")).grade
    value = grade(OUTPUT, {"reference": REFERENCE}).reward
    assert value == pytest.approx(meteor_score([REFERENCE.split()], OUTPUT.split(), wordnet=NoSynonyms()))
    # Porter stems match ("running" ~ "run", "dogs" ~ "dog"): precision = recall = 1, so Fmean = 1,
    # and the two matches form one chunk: penalty 0.5 * (1 chunk / 2 matches) ^ 3
    stemmed = grade("running dogs", {"reference": "run dog"}).reward
    assert stemmed == pytest.approx(1 - 0.5 * (1 / 2) ** 3)
    # a synonym would need WordNet, which is off: no match at all
    assert grade("automobile", {"reference": "car"}).reward == 0.0


@pytest.mark.parametrize("metric", ["fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_l"])
def test_similarity_identical_and_disjoint(metric):
    grader = graders.build(similarity(metric))
    text = "graders score the model output against a reference answer"
    assert grader.grade(text, {"reference": text}).reward == pytest.approx(1.0, abs=1e-3)
    assert grader.grade("zebra quantum", {"reference": text}).reward < 0.2
    assert grader.grade("", {"reference": text}).reward == 0.0


def test_cosine_is_refused_and_pass_threshold():
    err = invalid(similarity("cosine"))
    assert err.param == "grader.evaluation_metric" and "not supported locally" in err.message
    assert invalid(similarity("jaccard")).param == "grader.evaluation_metric"
    grader = graders.build(similarity("rouge_1", pass_threshold=0.8))
    assert grader.pass_threshold == 0.8 and grader.to_json()["pass_threshold"] == 0.8
    assert grader.passed(grader.grade(OUTPUT, {"reference": REFERENCE}))  # 0.833
    assert not grader.passed(grader.grade("the dog", {"reference": REFERENCE}))
    assert invalid(similarity("bleu", pass_threshold="high")).param == "grader.pass_threshold"


# ---- multi ----------------------------------------------------------------------------------


def multi(formula, **parts):
    parts = parts or {"a": check("eq", reference="{{item.answer}}"), "b": check("like", reference="x")}
    return {"type": "multi", "name": "combo", "graders": parts, "calculate_output": formula}


@pytest.mark.parametrize("formula,expected", [
    ("a + b", 1.0), ("(a + 3) * 2 - b / 4", 8.0), ("2 ^ 3 ^ 2", 2.0 ** 9), ("-a + 0.5", -0.5),
    ("min(a, b, 0.25) + max(a, b)", 1.0), ("abs(b - 2)", 2.0), ("floor(2.7) + ceil(a / 3)", 3.0),
    ("exp(a) * sqrt(16)", math.e * 4), ("log(exp(2)) + log(8, 2)", 5.0), ("1e-1 * 10", 1.0),
])
def test_multi_formulas(formula, expected):
    result = graders.build(multi(formula)).grade("Paris", {"answer": "Paris"})  # a = 1, b = 0
    assert result.reward == pytest.approx(expected) and not result.errors.any
    assert result.sub_rewards == {"a": 1.0, "b": 0.0} and result.type == "multi"


@pytest.mark.parametrize("formula,named", [
    ("__import__('os').system('true')", "__import__"), ("pow(a, 2)", "pow"), ("a + c", "c"),
    ("a.__class__", None), ("[a][0]", None), ("a if b else 1", None), ("(lambda: 1)()", None), ("a or b", None),
    ("'x' * 3", None), ("a % 2", None), ("a < b", None), ("max(a, key=b)", None), ("exp()", None), ("a +", None),
    ("abs(a, b)", None),
])
def test_multi_refuses_unsafe_or_unknown_formulas(formula, named):
    err = invalid(multi(formula))
    assert err.param == "grader.calculate_output"
    if named:
        assert named in err.message


def test_multi_math_errors_score_zero_with_a_flag():
    for formula in ("a / b", "log(b)", "sqrt(b - 1)", "10 ^ 400", "9 ^ 9 ^ 9"):
        result = graders.build(multi(formula)).grade("Paris", {"answer": "Paris"})
        assert result.reward == 0.0 and result.errors.formula_parse_error, formula
        assert result.sub_rewards == {"a": 1.0, "b": 0.0}


def test_multi_validation_names_nested_fields():
    bad = multi("a + b", a=check("eq"), b={**similarity("bleu"), "evaluation_metric": "cosine"})
    assert invalid(bad).param == "grader.graders.b.evaluation_metric"
    assert invalid(multi("a", a=multi("1"))).param == "grader.graders.a.type"  # no multi inside multi
    assert invalid({**multi("1"), "graders": {}}).param == "grader.graders"
    one = graders.validate({**multi("exact * 2"), "graders": check("eq", name="exact")})  # the client types' spelling
    assert list(one.graders) == ["exact"]
    assert graders.validate(one.to_json()).to_json() == one.to_json()


def test_multi_of_python_callables_and_error_propagation():
    def length(sample, item):
        return len(sample["output_text"])

    def broken(sample, item):
        raise KeyError("nope")

    combo = graders.MultiGrader.of("combo", {"n": length, "e": check("eq"), "bad": broken}, "n * 10 + e + bad")
    result = combo.grade("abc", {"answer": "abc"})
    assert result.reward == 31.0 and result.sub_rewards == {"n": 3.0, "e": 1.0, "bad": 0.0}
    assert result.errors.python_grader_runtime_error and "KeyError" in result.errors.python_grader_runtime_error_details
    with pytest.raises(FormulaError):
        graders.MultiGrader.of("x", {"n": length}, "m + 1")


def test_plain_callables_are_graders():
    grader = graders.build(lambda sample, item: float(sample["output_text"] == item["answer"]))
    assert grader.grade("4", {"answer": "4"}).reward == 1.0
    result = graders.build(lambda s, i: "yes").grade("4")
    assert result.reward == 0.0 and "must return a number" in result.errors.python_grader_runtime_error_details
    results = graders.grade_many(lambda s, i: len(s["output_text"]), ["a", "bb", "ccc"])
    assert [r.reward for r in results] == [1.0, 2.0, 3.0]
    assert graders.build(check("eq")).grade(123).errors.sample_parse_error


# ---- python (sandboxed) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    p = graders.SandboxPool(size=2, limits=graders.SandboxLimits(timeout_s=1.5, memory_bytes=512 << 20))
    yield p
    p.close()


def run_python(pool, source, sample="hello", item=None):
    return graders.build(python(source), pool=pool).grade(sample, item or {})


def test_python_grader_success_and_worker_reuse(pool):
    source = "import json\ndef grade(sample, item):\n    return len(sample['output_text']) / item['n']\n"
    before = pool.started
    rewards = [run_python(pool, source, "x" * k, {"n": 4}).reward for k in range(1, 5)]
    assert rewards == [0.25, 0.5, 0.75, 1.0]
    assert pool.started - before <= 1  # one worker served them all: no interpreter per sample
    numpy_like = "from fractions import Fraction\ndef grade(sample, item):\n    return Fraction(1, 4)\n"
    assert run_python(pool, numpy_like).reward == 0.25  # any real number type counts


def test_python_grader_failures_are_flagged(pool):
    result = run_python(pool, "def grade(sample, item):\n    return 1 / 0\n")
    assert result.reward == 0.0 and result.errors.python_grader_runtime_error
    assert "ZeroDivisionError" in result.errors.python_grader_runtime_error_details
    assert "line 2, in grade" in result.errors.python_grader_runtime_error_details
    for source, why in (("def grade(s, i):\n    return 'high'\n", "got str"),
                        ("def grade(s, i):\n    return float('nan')\n", "finite"),
                        ("def grade(s, i):\n    return None\n", "got NoneType"),
                        ("grade = 3\n", "no grade(sample, item) function")):
        result = run_python(pool, source)
        assert result.reward == 0.0 and result.errors.python_grader_runtime_error, source
        assert why in result.errors.python_grader_runtime_error_details
    result = run_python(pool, "import sys\ndef grade(s, i):\n    sys.exit(3)\n")
    assert "SystemExit" in result.errors.python_grader_runtime_error_details


def test_python_grader_timeout_replaces_the_worker(pool):
    replaced = pool.replaced
    start = time.monotonic()
    result = run_python(pool, "def grade(s, i):\n    while True:\n        pass\n")
    assert time.monotonic() - start < 6
    assert result.reward == 0.0 and result.errors.python_grader_server_error
    assert result.errors.python_grader_server_error_type == "timeout" and result.errors.unresponsive_reward_error
    assert pool.replaced == replaced + 1
    assert run_python(pool, "def grade(s, i):\n    return 1\n").reward == 1.0


def test_python_grader_memory_limit(pool):
    result = run_python(pool, "def grade(s, i):\n    x = bytearray(2 << 30)\n    return 1\n")
    assert result.reward == 0.0 and result.errors.python_grader_runtime_error
    assert "MemoryError" in result.errors.python_grader_runtime_error_details
    assert run_python(pool, "def grade(s, i):\n    return len(bytearray(64 << 20)) > 0\n").reward == 1.0


def test_python_grader_has_no_network(pool):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        for attempt in (f"socket.create_connection(('127.0.0.1', {port}), timeout=1)",
                        "socket.socket(socket.AF_INET, socket.SOCK_DGRAM)",
                        "socket.getaddrinfo('localhost', 80)",
                        "__import__('urllib.request').request.urlopen('http://127.0.0.1:%d' % " + str(port) + ")",
                        "__import__('subprocess').run(['true'])",
                        "__import__('ctypes').CDLL('libc.so.6')"):
            result = run_python(pool, f"import socket\ndef grade(s, i):\n    {attempt}\n    return 1\n")
            assert result.reward == 0.0 and result.errors.python_grader_runtime_error, attempt
            assert "PermissionError" in result.errors.python_grader_runtime_error_details, attempt
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing ever connected
    finally:
        listener.close()
    assert pool.network_isolation in ("user+network namespace", "network namespace", "audit-hook")


def test_python_grader_crash_and_stdio_do_not_break_the_pool(pool):
    replaced = pool.replaced
    result = run_python(pool, "import faulthandler\ndef grade(s, i):\n    faulthandler._sigsegv()\n")
    assert result.reward == 0.0 and result.errors.python_grader_server_error
    assert result.errors.python_grader_server_error_type == "crash" and pool.replaced == replaced + 1
    result = run_python(pool, "import os, signal\ndef grade(s, i):\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    assert result.errors.python_grader_server_error_type == "crash"
    noisy = ("import sys\ndef grade(s, i):\n    print('x' * 100000)\n    sys.stdin.read()\n"
             "    sys.stdout.write('{\"id\": 1}\\n')\n    return 0.5\n")
    assert [run_python(pool, noisy).reward for _ in range(2)] == [0.5, 0.5]
    assert run_python(pool, "import os\ndef grade(s, i):\n    os.kill(1, 0)\n").errors.python_grader_runtime_error
    # grader code that finds the reply pipe and forges a reply cannot pass it off as the worker's
    forger = ("import json, os\ndef grade(s, i):\n"
              "    line = json.dumps({'id': 'guess', 'ok': True, 'value': 1.0, 'cpu_s': 0}) + '\\n'\n"
              "    for fd in map(int, os.listdir('/proc/self/fd')):\n"
              "        try:\n            os.write(fd, line.encode())\n        except OSError:\n            pass\n"
              "    return 0.0\n")
    result = run_python(pool, forger)
    assert result.reward == 0.0 and result.errors.python_grader_server_error_type == "crash"
    assert run_python(pool, "def grade(s, i):\n    return 1\n").reward == 1.0


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\tZ" not in next(line for line in f if line.startswith("State:"))
    except (FileNotFoundError, StopIteration):
        return False


def test_workers_die_with_their_parent(tmp_path):
    """A parent killed mid-call (a sleeping grader, no CPU used) leaves no worker behind."""
    script = (
        "import os, signal, threading, time\n"
        "from kiln import graders\n"
        "pool = graders.SandboxPool(size=1)\n"
        "source = 'import time\\ndef grade(s, i):\\n    time.sleep(600)\\n'\n"
        "grader = graders.build({'type': 'python', 'name': 'p', 'source': source}, pool=pool)\n"
        "threading.Thread(target=grader.grade, args=('x',), daemon=True).start()\n"
        "while not pool.started:\n"
        "    time.sleep(0.05)\n"
        "time.sleep(0.3)\n"
        "print(pool.pids(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout
    (pid,) = json.loads(out)
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_grade_many_runs_python_graders_concurrently(pool):
    source = "import time\ndef grade(sample, item):\n    time.sleep(0.6)\n    return item['k'] * 2\n"
    graders.grade_many(python("def grade(s, i):\n    return 0\n"), ["a", "b"], [{}, {}], pool=pool)  # warm up
    start = time.monotonic()
    results = graders.grade_many(python(source), ["s"] * 4, [{"k": k} for k in range(4)], pool=pool)
    elapsed = time.monotonic() - start
    assert [r.reward for r in results] == [0.0, 2.0, 4.0, 6.0]
    assert elapsed < 2.2  # 2 workers: about 1.2 s; one after another would take 2.4 s


def test_python_grader_validation():
    assert invalid(python("def grade(s, i):\n    return (\n")).param == "grader.source"
    err = invalid(python("def score(s, i):\n    return 1\n"))
    assert err.param == "grader.source" and "grade" in err.message
    assert invalid(python("x" * (300 * 1024))).param == "grader.source"
    grader = graders.validate({**python("def grade(s, i):\n    return 1\n"), "image_tag": "2025-05-08"})
    assert grader.image_tag == "2025-05-08" and grader.to_json()["image_tag"] == "2025-05-08"  # kept, unused


# ---- score_model / label_model with a plain-function judge ----------------------------------


class FakeJudge:
    def __init__(self, *replies):
        self.replies, self.calls = list(replies), []

    def __call__(self, model, messages, params):
        self.calls.append((model, messages, params))
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def score_model(range_=None, **extra):
    grader = {"type": "score_model", "name": "judge", "model": "judge-model",
              "input": [{"role": "developer", "content": "You grade answers."},
                        {"role": "user", "content": "Q: {{item.question}} A: {{sample.output_text}}"}], **extra}
    if range_ is not None:
        grader["range"] = range_
    return grader


def test_score_model_prompt_parse_and_clamp():
    judge = FakeJudge('{"result": 0.7}', 'Reasoning... {"steps": [], "result": "8"}', "Score: 8/10", "15", "-3",
                      "```json\n{\"score\": 2.5}\n```")
    grader = graders.build(score_model(sampling_params={"temperature": 0.2, "max_completions_tokens": 32}))
    result = grader.grade("4", {"question": "2+2?"}, judge)
    assert result.reward == pytest.approx(0.7) and not result.errors.any
    model, messages, params = judge.calls[0]
    assert model == "judge-model" and params == {"temperature": 0.2, "max_completions_tokens": 32}
    assert [m["role"] for m in messages] == ["system", "user"]  # developer -> system, instruction added to it
    assert messages[0]["content"].startswith("You grade answers.") and '"result"' in messages[0]["content"]
    assert messages[1]["content"] == "Q: 2+2? A: 4"
    ten = graders.build(score_model([0, 10]))
    assert [ten.grade("x", {}, judge).reward for _ in range(5)] == [8.0, 8.0, 10.0, 0.0, 2.5]
    assert ten.to_json()["range"] == [0.0, 10.0] and graders.build(score_model()).range == [0.0, 1.0]


def test_score_model_failures_are_flagged():
    grader = graders.build(score_model())
    result = grader.grade("x", {}, FakeJudge("I cannot say."))
    assert result.reward == 0.0 and result.errors.model_grader_parse_error
    assert result.scores["judge_output"] == "I cannot say." and result.sampled_model_name == "judge-model"
    result = grader.grade("x", {}, FakeJudge(RuntimeError("engine down")))
    assert result.errors.model_grader_server_error
    assert result.errors.model_grader_server_error_details == "RuntimeError: engine down"
    assert grader.grade("x", {}).errors.model_grader_server_error  # no judge given


def test_judge_reply_token_usage():
    result = graders.build(score_model()).grade("x", {}, lambda m, msgs, p: graders.JudgeReply("1", 30, 4))
    assert result.reward == 1.0 and result.token_usage == 34
    assert result.to_openai()["model_grader_token_usage_per_model"] == {
        "judge-model": {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34}}


def test_label_model():
    content = [{"type": "input_text", "text": "{{sample.output_text}}"}, " -- is it right?"]
    grader = graders.build({"type": "label_model", "name": "lbl", "model": "judge-model",
                            "input": [{"role": "user", "content": content}],
                            "labels": ["correct", "incorrect"], "passing_labels": ["correct"]})
    replies = {"incorrect": 0.0, "Correct.": 1.0, '{"label": "correct"}': 1.0,
               "It is correct, not incorrect": 1.0, "**Incorrect**": 0.0}
    for reply, reward in replies.items():
        result = grader.grade("42", {}, FakeJudge(reply))
        assert result.reward == reward and not result.errors.any, reply
    judge = FakeJudge("maybe")
    result = grader.grade("42", {}, judge)
    assert result.reward == 0.0 and result.errors.model_grader_parse_error
    assert judge.calls[0][1][1]["content"] == "42 -- is it right?" and "correct, incorrect" in judge.calls[0][1][0][
        "content"]


def test_model_grader_validation():
    base = {"type": "label_model", "name": "l", "model": "m", "input": [{"role": "user", "content": "x"}],
            "labels": ["a", "b"], "passing_labels": ["a"]}
    assert invalid({**base, "passing_labels": ["c"]}).param == "grader.passing_labels"
    assert invalid({**base, "labels": []}).param == "grader.labels"
    assert invalid({**base, "input": []}).param == "grader.input"
    assert invalid({**base, "input": [{"role": "robot", "content": "x"}]}).param == "grader.input[0].role"
    image = [{"role": "user", "content": {"type": "input_image", "image_url": "http://x/y.png"}}]
    err = invalid({**base, "input": image})
    assert err.param == "grader.input[0].content.type" and "not supported locally" in err.message
    assert invalid(score_model([1, 0])).param == "grader.range"
    assert invalid(score_model(sampling_params={"top_p": 0})).param == "grader.sampling_params.top_p"
    assert invalid({**score_model(), "model": None}).param == "grader.model"


def test_multi_with_model_parts_sums_usage():
    combo = graders.build(multi("s + l", s=score_model(), l={
        "type": "label_model", "model": "judge-model", "input": [{"role": "user", "content": "x"}],
        "labels": ["yes", "no"], "passing_labels": ["yes"]}))
    replies = iter([graders.JudgeReply("0.5", 10, 2), graders.JudgeReply("yes", 5, 1)])
    result = combo.grade("x", {}, lambda m, msgs, p: next(replies))
    assert result.reward == 1.5 and result.sub_rewards == {"s": 0.5, "l": 1.0}
    assert result.token_usage == 18 and result.token_usage_per_model["judge-model"]["total_tokens"] == 18
    assert combo.judge_models() == {"judge-model"}


@pytest.mark.parametrize("grader,param", [
    (multi("a\x00"), "grader.calculate_output"), (multi("-" * 100000 + "a"), "grader.calculate_output"),
    (multi("(" * 1000 + "a" + ")" * 1000), "grader.calculate_output"), (multi("1" * 5000), "grader.calculate_output"),
    (python("def grade(s, i):\x00"), "grader.source"), (python("x = " + "(" * 10000), "grader.source"),
    ({**check("eq"), "pass_threshold": 10 ** 400}, "grader.pass_threshold"),
    (score_model([0, 10 ** 400]), "grader.range"),
    ({**multi("a"), "graders": {"a": 3}}, "grader.graders.a"), ({**multi("a"), "graders": []}, "grader.graders"),
])
def test_hostile_json_is_a_400_not_a_crash(grader, param):
    assert invalid(grader).param == param


def test_errors_carry_every_openai_flag():
    from openai.types.fine_tuning.alpha.grader_run_response import MetadataErrors

    ours = set(graders.GradeResult(0.0).to_openai()["metadata"]["errors"])
    theirs = {f.alias or name for name, f in MetadataErrors.model_fields.items()}
    assert ours == theirs and set(FLAGS) <= ours


# ---- the HTTP routes on a real server -------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the session's shared tiny-model server (served as MODEL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_server_runs_basic_graders(client):
    r = client.fine_tuning.alpha.graders.run(grader=check("ilike"), model_sample="The answer is PARIS",
                                             item={"answer": "paris"})
    assert r.reward == 1.0 and r.metadata.name == "check" and r.metadata.type == "string_check"
    assert not any(getattr(r.metadata.errors, f) for f in type(r.metadata.errors).model_fields if f.endswith("error"))
    from rapidfuzz import fuzz

    r = client.fine_tuning.alpha.graders.run(grader=similarity("fuzzy_match"), model_sample=OUTPUT,
                                             item={"reference": REFERENCE})
    assert r.reward == pytest.approx(fuzz.ratio(OUTPUT, REFERENCE) / 100)
    source = "def grade(sample, item):\n    return sample['output_json']['n'] / item['d']\n"
    r = client.fine_tuning.alpha.graders.run(grader=python(source), model_sample='{"n": 3}', item={"d": 4})
    assert r.reward == 0.75 and r.metadata.type == "python"
    r = client.fine_tuning.alpha.graders.run(grader=python("def grade(s, i):\n    raise ValueError('bad')\n"),
                                             model_sample="x")
    assert r.reward == 0.0 and r.metadata.errors.python_grader_runtime_error
    assert "ValueError: bad" in r.metadata.errors.python_grader_runtime_error_details
    combo = multi("2 * exact + py", exact=check("eq"), py=python(source))
    r = client.fine_tuning.alpha.graders.run(grader=combo, model_sample='{"n": 1}', item={"answer": '{"n": 1}', "d": 2})
    assert r.reward == 2.5 and r.sub_rewards == {"exact": 1.0, "py": 0.5}


def test_server_score_model_judged_by_the_served_model(client):
    grader = score_model([0, 10], sampling_params={"max_completions_tokens": 8, "temperature": 0})
    grader["model"] = MODEL
    first = client.fine_tuning.alpha.graders.run(grader=grader, model_sample="4", item={"question": "2+2?"})
    second = client.fine_tuning.alpha.graders.run(grader=grader, model_sample="4", item={"question": "2+2?"})
    assert first.metadata.sampled_model_name == MODEL and first.metadata.type == "score_model"
    usage = first.model_grader_token_usage_per_model[MODEL]
    assert 1 <= usage["completion_tokens"] <= 8 and usage["prompt_tokens"] > 20
    assert first.metadata.token_usage == usage["total_tokens"]
    output = first.metadata.scores["judge_output"]
    assert second.metadata.scores["judge_output"] == output  # greedy: the same judgement twice
    score = graders.model.parse_score(output)
    if score is None:  # the random tiny model's usual reply
        assert first.reward == 0.0 and first.metadata.errors.api_model_grader_parse_error
    else:
        assert first.reward == min(max(score, 0), 10) and not first.metadata.errors.api_model_grader_parse_error


def test_server_validate(client):
    r = client.fine_tuning.alpha.graders.validate(grader=score_model())
    assert r.grader.type == "score_model" and r.grader.range == [0.0, 1.0] and r.grader.name == "judge"
    r = client.fine_tuning.alpha.graders.validate(grader=multi("a + b"))
    assert r.grader.type == "multi" and r.grader.calculate_output == "a + b"
    assert set(r.grader.model_extra["graders"]) == {"a", "b"}


def test_server_errors(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.fine_tuning.alpha.graders.run(grader=check("regex"), model_sample="x")
    assert info.value.param == "grader.operation" and info.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as info:
        client.fine_tuning.alpha.graders.validate(grader=multi("a + __import__('os').getpid()"))
    assert info.value.param == "grader.calculate_output" and "__import__" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.fine_tuning.alpha.graders.validate(grader=similarity("cosine"))
    assert info.value.param == "grader.evaluation_metric"
    r = httpx.post(server.url + "/v1/fine_tuning/alpha/graders/run", json={"grader": check("eq")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_sample"
    r = httpx.post(server.url + "/v1/fine_tuning/alpha/graders/run", json={"model_sample": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grader"
    with pytest.raises(openai.NotFoundError) as info:
        client.fine_tuning.alpha.graders.run(grader=score_model(), model_sample="x")  # no such judge model
    assert info.value.param == "grader.model"
    with pytest.raises(openai.NotFoundError) as info:
        client.fine_tuning.alpha.graders.run(grader=multi("j", j=score_model()), model_sample="x")
    assert info.value.param == "grader.graders.j.model"


def test_concurrent_python_runs_on_the_server(client):
    source = "def grade(sample, item):\n    return float(sample['output_text'])\n"
    results = [None] * 6

    def one(k):
        results[k] = client.fine_tuning.alpha.graders.run(grader=python(source), model_sample=str(k)).reward

    threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
