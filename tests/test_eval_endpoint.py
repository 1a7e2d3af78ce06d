"""`eval --endpoint URL`: a served model scored through lm-eval's local-chat-completions, against a minimal
OpenAI-compatible stand-in server on 127.0.0.1 (it answers the questions it knows, so the score is known); bad
input one line before the server is sent a request."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

pytest.importorskip("lm_eval", reason="lm-eval (the [eval] extra) is not installed")
pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api]")

from praisonai_accel.cli import app  # noqa: E402

QUESTIONS = [f"say {word}" for word in ("red", "blue", "green", "gold", "black", "white")]
KNOWN = {q: q.split()[1] for q in QUESTIONS[:3]}  # the stand-in answers these right, the rest wrong: 0.5

GEN_YAML = """task: say_it
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""

MC_YAML = """task: pick_it
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: ["red", "blue"]
doc_to_target: 0
metric_list:
  - metric: acc
"""


class StandIn(BaseHTTPRequestHandler):
    requests: list = []

    def log_message(self, *args):
        pass

    def _reply(self, payload: dict, code: int = 200):
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._reply({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})
        else:
            self._reply({"error": "not found"}, 404)

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(payload)
        if self.path != "/v1/chat/completions" or len(type(self).requests) > 50:  # bounded
            self._reply({"error": "refused"}, 400)
            return
        question = payload["messages"][-1]["content"].strip()
        answer = KNOWN.get(question, "no idea")
        self._reply({"id": "x", "object": "chat.completion", "model": payload["model"],
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": answer}}]})


@pytest.fixture(scope="module")
def server():
    StandIn.requests = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("endpoint_tasks")
    rows = [{"question": q, "answer": q.split()[1]} for q in QUESTIONS]
    (root / "say_it.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "say_it.yaml").write_text(GEN_YAML.format(data=root / "say_it.jsonl"))
    (root / "pick_it.yaml").write_text(MC_YAML.format(data=root / "say_it.jsonl"))
    return root


def _invoke(*args: str):
    return CliRunner().invoke(app, ["eval", *args])


def test_a_served_model_is_scored_through_lm_evals_chat_completions(server, tasks, tmp_path):
    StandIn.requests.clear()
    out = tmp_path / "e.json"
    result = _invoke("--endpoint", server, "--tasks", "say_it", "--include-path", str(tasks), "--output", str(out))
    assert result.exit_code == 0, result.output[-3000:]
    scored = json.loads(out.read_text())
    assert scored["tuned"]["results"]["say_it"]["exact_match,none"] == pytest.approx(0.5)
    assert scored["model"] == "stand-in" and scored["endpoint"]["lm_eval_model"] == "local-chat-completions"
    assert len(StandIn.requests) == len(QUESTIONS)
    assert all(r["model"] == "stand-in" and r["temperature"] == 0 and r["max_tokens"] == 8 for r in StandIn.requests)
    assert "say_it" in result.output and "exact_match" in result.output


def test_model_name_and_limit_are_passed(server, tasks, tmp_path):
    StandIn.requests.clear()
    result = _invoke("--endpoint", server + "/", "--model-name", "reverser", "--tasks", "say_it", "--include-path",
                     str(tasks), "--limit", "2", "--output", str(tmp_path / "e.json"))
    assert result.exit_code == 0, result.output[-3000:]
    assert [r["model"] for r in StandIn.requests] == ["reverser", "reverser"]
    assert json.loads((tmp_path / "e.json").read_text())["tuned"]["results"]["say_it"]["exact_match,none"] == 1.0


@pytest.mark.parametrize("args,line", [
    (["--tasks", "pick_it"], "--tasks pick_it: a multiple_choice task needs log-probabilities"),
    (["--tasks", "say_it", "--base"], "--base / --max-regression: not with --endpoint"),
    (["--tasks", "say_it", "--num-processes", "2"], "--num-processes / --gpus: not with --endpoint"),
    (["--tasks", "say_it", "--reward-model", "rm"], "--reward-model: not with --endpoint"),
    (["--tasks", "say_it", "TARGET"], "--endpoint: scores the served model; drop TARGET"),
    ([], "--endpoint: name the tasks to score with --tasks"),
])
def test_bad_endpoint_input_is_one_line_before_any_request(server, tasks, args, line):
    StandIn.requests.clear()
    args = [a if a != "TARGET" else "outputs" for a in args]
    target = [a for a in args if a == "outputs"]
    options = [a for a in args if a != "outputs"]
    result = _invoke(*target, "--endpoint", server, "--include-path", str(tasks), *options)
    assert result.exit_code == 2, result.output[-2000:]
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and line in errors[0], result.output[-2000:]
    assert StandIn.requests == []


def test_an_endpoint_that_is_not_there_is_one_line(tasks):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    for url, line in ((f"http://127.0.0.1:{port}/v1", "cannot list its models"),
                      (f"http://127.0.0.1:{port}", "give the /v1 base URL serve printed")):
        result = _invoke("--endpoint", url, "--tasks", "say_it", "--include-path", str(tasks))
        assert result.exit_code == 2, result.output[-2000:]
        errors = [x for x in result.output.splitlines() if x.startswith("error:")]
        assert len(errors) == 1 and line in errors[0], result.output[-2000:]
