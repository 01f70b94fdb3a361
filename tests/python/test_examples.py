"""The examples run: the Python LoRA and full fine-tuning (kt's AdamW), the serving loop and the libtorch C++ program."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_finetune_moe_example(mode):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "plugins", "python"))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "finetune_moe.py"),
                          "--steps", "40", "--log-every", "10", "--mode", mode],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    losses = [float(v) for v in re.findall(r"^step \d+ loss ([0-9.]+)", out.stdout, re.M)]
    assert len(losses) == 5, out.stdout  # steps 1, 10, 20, 30, 40
    assert losses[-1] < 0.6 * losses[0], out.stdout
    assert re.search(r"\(\d+ tokens/s\)", out.stdout)
    assert "\r" not in out.stdout  # no progress bar when stdout is not a terminal
    assert "%s fine-tune" % mode in out.stdout and "kt AdamW" in out.stdout


@pytest.mark.skipif(not os.environ.get("KT_LIBTORCH_EXAMPLE"),
                    reason="KT_LIBTORCH_EXAMPLE not set (libtorch plugin not built)")
def test_cpp_libtorch_example():
    """kt's LayerOptimizer and libtorch's AdamW train the same numbers."""
    runs = {}
    for optimizer in ("kt", "torch"):
        out = subprocess.run([os.environ["KT_LIBTORCH_EXAMPLE"], "60", optimizer], capture_output=True,
                             text=True, timeout=240)
        assert out.returncode == 0, out.stdout + out.stderr
        losses = [float(v) for v in re.findall(r"^step \d+ loss ([0-9.]+)", out.stdout, re.M)]
        assert len(losses) == 60
        assert "trained" in out.stdout and losses[-1] < losses[0]
        runs[optimizer] = losses
    assert runs["kt"] == runs["torch"]


def test_serve_moe_example_generates_the_torch_experts_tokens():
    """The serving loop with kt experts (async submit/wait beside torch's
    shared expert) decodes greedily the same tokens as with torch experts."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "plugins", "python"))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "serve_moe.py"),
                          "--batch", "3", "--prompt", "7", "--new-tokens", "10", "--precision", "fp32"],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    tokens = {}
    for name, seq, values in re.findall(r"^tokens (kt|torch) (\d+): ([\d ]+)$", out.stdout, re.M):
        tokens[(name, int(seq))] = [int(v) for v in values.split()]
    assert sorted(tokens) == [(n, b) for n in ("kt", "torch") for b in range(3)], out.stdout
    for b in range(3):
        assert len(tokens[("kt", b)]) == 10
        assert tokens[("kt", b)] == tokens[("torch", b)], out.stdout
    assert len({t for b in range(3) for t in tokens[("kt", b)]}) > 5  # not one repeated token
    for name in ("kt", "torch"):
        assert re.search(r"^%s experts: prefill \d+ tokens/s, decode [\d.]+ tokens/s" % name, out.stdout, re.M)
    assert "generated the same tokens: yes" in out.stdout
