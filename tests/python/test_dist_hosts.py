"""kt.dist expert parallel across two network namespaces joined by a delaying
link (bench/dist_hosts.py at a small shape): every rank's y, dx,
routing-weight and LoRA gradients have one process's bits at delays 0 and
50 µs, the link really delays, and every time is there and positive."""
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DRIVER = os.path.join(ROOT, "bench", "dist_hosts.py")


def _why_not():
    import kt
    if "gloo" not in kt.build_info():
        return "kt built without Gloo"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    if not shutil.which("ip"):
        return "no `ip` (iproute2)"
    name = "ktprobe%d" % os.getpid()
    made = subprocess.run(["ip", "netns", "add", name], stderr=subprocess.PIPE, text=True)
    if made.returncode != 0:
        return "ip netns add failed: " + made.stderr.strip()
    subprocess.run(["ip", "netns", "del", name])
    return None


def _link_program(tmp_path):
    """The built kt_delay_link (ctest passes it), else one compiled here."""
    built = os.environ.get("KT_DELAY_LINK") or os.path.join(ROOT, "build", "bench", "kt_delay_link")
    if os.access(built, os.X_OK):
        return built
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("kt_delay_link is not built and there is no C compiler")
    out = str(tmp_path / "kt_delay_link")
    subprocess.run([cc, "-O2", "-o", out, os.path.join(ROOT, "bench", "delay_link.c")], check=True)
    return out


def test_expert_parallel_across_namespaces_matches_one_process(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(why)
    out = tmp_path / "hosts.json"
    run = subprocess.run(
        [sys.executable, DRIVER, "--experts", "8", "--top-k", "2", "--hidden", "64", "--intermediate", "32",
         "--lora-rank", "4", "--tokens", "1,16", "--delays", "0,50", "--reps", "6", "--pings", "100",
         "--bulk-mib", "4", "--timeout", "240", "--link", _link_program(tmp_path), "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert run.returncode == 0, run.stdout
    res = json.loads(out.read_text())
    assert res["bit_identical"] == {"loopback": True, "netns-0us": True, "netns-50us": True}, res["mismatches"]
    # The ranks' checked bits cover every expert once.
    assert sorted(e for r in res["runs"]["netns-50us"] for e in r["experts"]) == list(range(8))
    # The link holds each packet 50 µs each way: a round trip of at least 100 µs.
    assert res["link"]["netns-50us"]["rtt_us_median"] >= 100.0
    assert res["link"]["netns-0us"]["rtt_us_median"] < res["link"]["netns-50us"]["rtt_us_median"]
    rows = res["table"]["rows"]
    assert [(r["tokens_per_rank"], r["pass"]) for r in rows] == [
        (1, "forward"), (1, "forward_backward"), (16, "forward"), (16, "forward_backward")]
    for r in rows:
        assert r["one_process_ms"] > 0 and r["loopback_ms"] > 0
        for name in ("netns-0us", "netns-50us"):
            assert r["netns"][name]["ms"] > 0 and r["netns"][name]["estimate_ms"] > 0
    assert "| 16 | forward+backward |" in run.stdout
