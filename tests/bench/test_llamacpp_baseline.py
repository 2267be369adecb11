"""--baseline llamacpp: its option checks, and the whole run (server start, health wait, concurrent
/completion requests, stop, token agreement) against a fake ``llama-server`` written by the test."""
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxengine.bench import llamacpp_baseline, throughput
from jaxengine.bench.__main__ import main
from jaxengine.bench.datasets import BenchRequest
from jaxengine.bench.llamacpp_baseline import run_llamacpp
from tests.bench.test_bench_cli import bench

# A stand-in for llama-server: answers /health 503 for a moment (loading), then 200; /completion
# returns FAKE_LLAMA_ORACLE's tokens for the prompt where that file has them, else the prompt's
# last token counted up. Records its argv, pid and every request body in FAKE_LLAMA_RECORD.
FAKE_SERVER = '''
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
record = os.environ["FAKE_LLAMA_RECORD"]
lock = threading.Lock()
def log(entry):
    with lock, open(record, "a") as f:
        f.write(json.dumps(entry) + "\\n")
log({"argv": argv, "pid": os.getpid()})
print("fake llama-server: loading", argv[argv.index("-m") + 1], flush=True)
if os.environ.get("FAKE_LLAMA_FAIL") == "exit":
    print("fake llama-server: failed to load the model", flush=True)
    sys.exit(3)
ready_at = time.monotonic() + 0.5

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if time.monotonic() < ready_at:
            self.reply(503, {"error": {"code": 503, "message": "Loading model"}})
        elif self.path == "/health":
            self.reply(200, {"status": "ok"})
        elif self.path == "/props":
            self.reply(200, {"build_info": "b0-fake"})
        else:
            self.reply(404, {})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log({"request": body})
        if os.environ.get("FAKE_LLAMA_FAIL") == "400":
            return self.reply(400, {"error": {"message": "invalid token id"}})
        prompt = body["prompt"]
        time.sleep(0.02 * (len(prompt) % 3))        # answers out of order
        oracle = os.environ.get("FAKE_LLAMA_ORACLE")
        oracle = json.load(open(oracle)) if oracle and os.path.exists(oracle) else {}
        tokens = oracle.get(json.dumps(prompt), [prompt[-1] + i for i in range(body["n_predict"])])
        self.reply(200, {"content": "", "tokens": tokens if body.get("return_tokens") else [],
                         "stop_type": "limit", "truncated": False})

ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
'''


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    """A folder holding the fake llama-server; returns (folder, record file)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    server = folder / "llama-server"
    server.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    server.chmod(0o755)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(record))
    return folder, record


def read_record(record: Path) -> tuple[dict, list[dict]]:
    """The fake server's (start entry, request bodies in arrival order)."""
    entries = [json.loads(line) for line in record.read_text().splitlines()]
    return entries[0], [e["request"] for e in entries[1:]]


def assert_stopped(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def options(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"llamacpp_bin": None, "llamacpp_model": None, "llamacpp_threads": None,
                              "model": None, **kw})


def test_the_option_checks_name_what_is_wrong(fake_bin, tmp_path):
    folder, _ = fake_bin
    check = llamacpp_baseline.check_options
    cases = [
        (options(), "--baseline llamacpp: needs --llamacpp-bin (the folder of llama.cpp's built binaries)"),
        (options(llamacpp_bin=str(tmp_path / "nothing")),
         f"--llamacpp-bin: {tmp_path / 'nothing'} is not a folder (llama.cpp's built binaries, e.g. build/bin)"),
        (options(llamacpp_bin=str(tmp_path)),
         f"--llamacpp-bin: {tmp_path / 'llama-server'} is not an executable (build llama.cpp's llama-server first)"),
        (options(llamacpp_bin=str(folder), model=str(tmp_path / "hf-folder")),
         f"--baseline llamacpp: the engine's model {tmp_path / 'hf-folder'} is not a GGUF file; give llama.cpp "
         "the same model as one with --llamacpp-model"),
        (options(llamacpp_bin=str(folder), llamacpp_model=str(tmp_path / "missing.gguf")),
         f"--llamacpp-model: {tmp_path / 'missing.gguf'} is not a file (a GGUF model)"),
        (options(llamacpp_bin=str(folder), llamacpp_threads=0), "--llamacpp-threads: 0 (at least 1)"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            check(args)
    (tmp_path / "llama-server").write_text("not executable")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'llama-server'} is not an executable")):
        check(options(llamacpp_bin=str(tmp_path)))
    # The default model and any GGUF pass; so does a non-GGUF engine model with --llamacpp-model.
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    check(options(llamacpp_bin=str(folder)))
    check(options(llamacpp_bin=str(folder), model=str(tmp_path / "model.gguf")))
    check(options(llamacpp_bin=str(folder), model=str(tmp_path), llamacpp_model=str(tmp_path / "model.gguf")))


def test_the_cli_checks_before_the_engine_starts(fake_bin, tmp_path):
    folder, _ = fake_bin
    run = ["throughput", "--result-file", str(tmp_path / "r.json"), "--baseline", "llamacpp"]
    with pytest.raises(ValueError, match=re.escape("--baseline llamacpp: needs --llamacpp-bin")):
        main(run)
    with pytest.raises(ValueError, match=re.escape(f"--llamacpp-bin: {tmp_path / 'bin' / 'x'} is not a folder")):
        main([*run, "--llamacpp-bin", str(folder / "x")])
    # A model folder that does not exist: the check, not the engine's loader, answers.
    with pytest.raises(ValueError, match=re.escape(f"the engine's model {tmp_path / 'hf'} is not a GGUF file")):
        main([*run, "--llamacpp-bin", str(folder), "--model", str(tmp_path / "hf")])
    with pytest.raises(ValueError, match="--beam-width: with --n 1, against --baseline hf only"):
        main([*run, "--llamacpp-bin", str(folder), "--beam-width", "2"])


def test_run_llamacpp_sends_every_request_and_keeps_their_order(fake_bin, tmp_path):
    folder, record = fake_bin
    requests = [BenchRequest([5, 6, 7][: 1 + i % 3] + [10 * i], 3 + i) for i in range(7)]
    figures, tokens = run_llamacpp(str(folder), str(tmp_path / "m.gguf"), requests, slots=4, slot_len=128,
                                   threads=3, progress=False)
    assert tokens == [[r.prompt_token_ids[-1] + k for k in range(r.output_len)] for r in requests]
    start, bodies = read_record(record)
    argv = start["argv"]
    assert argv[:6] == ["-m", str(tmp_path / "m.gguf"), "--host", "127.0.0.1", "--port", argv[5]]
    assert argv[6:] == ["-np", "4", "-c", "512", "--cont-batching", "-t", "3", "--no-cache-prompt",
                        "--cache-ram", "0"]
    assert sorted(map(json.dumps, bodies)) == sorted(json.dumps(
        {"prompt": r.prompt_token_ids, "n_predict": r.output_len, "temperature": 0.0, "ignore_eos": True,
         "cache_prompt": False, "return_tokens": True, "stream": False}) for r in requests)
    assert figures["elapsed_s"] > 0 and figures["load_s"] >= 0.5        # /health said 503 for 0.5 s
    assert figures["server"] == {"model": str(tmp_path / "m.gguf"), "parallel": 4, "ctx_size": 512, "threads": 3,
                                 "command": [str(folder / "llama-server"), *argv], "build_info": "b0-fake"}
    assert_stopped(start["pid"])


def test_a_server_that_exits_or_refuses_is_reported_with_its_log_and_stopped(fake_bin, tmp_path, monkeypatch):
    folder, record = fake_bin
    requests = [BenchRequest([1, 2], 2)] * 3
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "exit")
    with pytest.raises(RuntimeError, match=r"(?s)llama-server exited with status 3 before it was ready:\n"
                                           r".*failed to load the model"):
        run_llamacpp(str(folder), "m.gguf", requests, 2, 64, 1, progress=False)
    record.unlink()
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "400")
    with pytest.raises(RuntimeError, match=r"(?s)/completion answered 400: .*invalid token id.*"
                                           r"fake llama-server: loading m.gguf"):
        run_llamacpp(str(folder), "m.gguf", requests, 2, 64, 1, progress=False)
    assert_stopped(read_record(record)[0]["pid"])


def test_run_baseline_defaults_to_the_engines_gguf_and_cpus(fake_bin, tmp_path):
    folder, record = fake_bin
    llm = SimpleNamespace(model_path=tmp_path / "engine.gguf",
                          config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=3, max_model_len=256)))
    args = SimpleNamespace(llamacpp_bin=str(folder), llamacpp_model=None, llamacpp_threads=None, progress=False)
    requests = [BenchRequest([4, 9], 2), BenchRequest([8], 3)]
    metrics = throughput.rates(2, 3, 5, 1.0)
    b = throughput.run_baseline("llamacpp", llm, requests, args, metrics, [[9, 10], [8, 0, 0]])
    server = b["server"]
    assert server["model"] == str(tmp_path / "engine.gguf") and server["threads"] == len(os.sched_getaffinity(0))
    assert server["parallel"] == 3 and server["ctx_size"] == 3 * 256
    assert b["output_tokens"] == 5 and b["output_tokens_per_s"] == 5 / b["elapsed_s"]
    assert b["same_tokens"] is False and b["mismatched_requests"] == 1       # the second request differs


def test_throughput_against_llamacpp_on_the_tiny_engine(chat_checkpoint, fake_bin, tmp_path, monkeypatch):
    """The engine's own greedy tokens as the fake server's answers: the agreement check holds."""
    folder, record = fake_bin
    oracle = tmp_path / "oracle.json"
    monkeypatch.setenv("FAKE_LLAMA_ORACLE", str(oracle))
    measure = throughput.measure

    def measured(llm, requests, *rest):
        result = measure(llm, requests, *rest)
        oracle.write_text(json.dumps({json.dumps(r.prompt_token_ids): t
                                      for r, t in zip(requests, result["tokens"])}))
        return result

    monkeypatch.setattr(throughput, "measure", measured)
    (tmp_path / "same.gguf").write_bytes(b"GGUF")
    result, saved = bench(chat_checkpoint, tmp_path, "throughput", "--num-prompts", "5", "--input-len", "4:12",
                          "--output-len", "6", "--baseline", "llamacpp", "--llamacpp-bin", str(folder),
                          "--llamacpp-model", str(tmp_path / "same.gguf"), "--llamacpp-threads", "2")
    m, b = result["metrics"], result["baselines"]["llamacpp"]
    assert saved["baselines"]["llamacpp"] == json.loads(json.dumps(b))
    assert b["same_tokens"] is True and b["mismatched_requests"] == 0
    assert b["num_requests"] == 5 and b["output_tokens"] == m["output_tokens"] == 30
    assert b["requests_per_s"] == 5 / b["elapsed_s"] and b["output_tokens_per_s"] == 30 / b["elapsed_s"]
    assert b["total_tokens_per_s"] == (m["prompt_tokens"] + 30) / b["elapsed_s"]
    assert b["ratio"]["output_tokens_per_s"] == m["output_tokens_per_s"] / b["output_tokens_per_s"]
    assert b["server"]["parallel"] == 4 and b["server"]["ctx_size"] == 4 * 128 and b["server"]["threads"] == 2
    start, bodies = read_record(record)
    assert sorted(len(x["prompt"]) for x in bodies) == sorted(result["requests"]["prompt_lens"])
    assert all(x["n_predict"] == 6 for x in bodies)
    assert_stopped(start["pid"])
