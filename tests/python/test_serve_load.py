"""vLLM's OpenAI-compatible server with kt's experts under a minute of
sustained load (bench/serve_load.py at test size): 8 clients sending a mix of
completions and chat, streamed or not, cancellations mid-stream, prompts
over the max length and malformed requests, with greedy answers checked
before, during and after the load and the server's memory sampled."""
import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (tools/python_env.sh serve makes a venv with it)")
pytest.importorskip("transformers", reason="transformers builds the test checkpoint")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench"))

import serve_load  # noqa: E402

# vLLM 0.32's answers to the refusals of the mix.
REFUSALS = {"too_long": {"400"}, "bad_json": {"400"}, "wrong_types": {"400"}, "unknown_model": {"404"}}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_load")
    args = serve_load.parse_args(["--seconds", "60", "--concurrency", "8", "--warmup", "20", "--greedy-every",
                                  "8", "--model-dir", str(tmp / "model"), "--log", str(tmp / "server.log")])
    out = serve_load.run(args)
    print(serve_load.table(out))
    return out


def test_no_errors_and_the_intended_refusals(report):
    (phase,) = report["phases"]
    assert phase["errors"] == 0, phase["error_reasons"]
    assert phase["done"] > 50 and phase["cancelled"] > 0, phase
    # Every kind of the mix was sent and answered as meant: the chat
    # endpoint too (the test checkpoint has a chat template).
    assert report["chat"]
    assert set(phase["done_by_kind"]) >= {"completion", "stream", "chat", "chat_stream"}, phase["done_by_kind"]
    assert {k: set(v) for k, v in phase["refusal_codes"].items()} == REFUSALS, phase["refusal_codes"]
    assert phase["refused"] == sum(phase["refused_by_reason"].values())
    assert phase["latency_p50_s"] <= phase["latency_p99_s"] and phase["tokens_per_s"] > 0


def test_greedy_answers_identical_under_load(report):
    (phase,) = report["phases"]
    assert len(report["greedy_before"]) == len(serve_load.GREEDY_PROMPTS)
    assert all(len(text.split()) > 0 for text in report["greedy_before"])
    assert phase["greedy_checks"] >= 3 and phase["greedy_mismatches"] == [], phase["greedy_mismatches"]
    assert report["greedy_after_identical"]


def test_server_memory_bounded(report):
    (phase,) = report["phases"]
    memory = phase["memory"]
    # The API server, its engine core and the worker holding the model.
    big = [p for p in memory["processes"] if p["rss_warm"] >= serve_load.BIG_PROCESS]
    assert len(big) >= 2, memory["processes"]
    assert memory["pss_total_end"], "PSS unreadable"
    assert memory["rss_growth_max_pct"] <= 2.0, (memory["processes"], memory["pss_by_mapping"])


def test_server_served_by_kt_and_stopped(report):
    assert report["kt_layers_logged"] == 2
    assert report["server_stop"]["by_sigterm"] and report["server_stop"]["processes_left"] == []
    assert report["failures"] == []
