"""kt's command: `kt-moe` (the wheel's console script) and `python -m kt` run
the kt tool shipped inside the package (kt/bin/kt-moe, which finds
kt/libkt.so.<abi> through its RUNPATH), in place of this Python process.

The command is named as the distribution, kt-moe: `kt` is kt-kernel's
command, and two wheels that both install a `kt` script overwrite each
other's without a word from pip.
"""
import importlib.util
import os
import sys

TOOL_NAME = "kt-moe"


def tool_path():
    """The kt tool inside this package, or None (a source checkout has it in
    the CMake build tree, build*/tools/kt-moe, instead)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", TOOL_NAME)
    return path if os.access(path, os.X_OK) else None


def main():
    path = tool_path()
    if path is None:
        sys.stderr.write("%s: the kt tool is not in this installation of the package (%s); "
                         "install kt with pip (pip install . in a clone of kt) or run build*/tools/%s\n"
                         % (TOOL_NAME, os.path.dirname(os.path.abspath(__file__)), TOOL_NAME))
        return 127
    # `kt-moe bench` runs its peers (kt-kernel, DeepSpeed, torch 2) with the
    # interpreter of this environment, where pip put them beside kt.
    env = dict(os.environ)
    env.setdefault("KT_BENCH_PEERS_PYTHON", sys.executable)
    # Where vLLM is installed here too (kt's vLLM plugin lives beside it), its
    # CPU fused MoE runs beside kt's forward; found without importing vLLM.
    if importlib.util.find_spec("vllm") is not None:
        env.setdefault("KT_BENCH_VLLM_PYTHON", sys.executable)
    # The environment's scripts come first on PATH, as in an activated venv:
    # DeepSpeed builds its CPU Adam op with the ninja that pip put there.
    scripts = os.path.dirname(sys.executable)
    env["PATH"] = scripts + (os.pathsep + env["PATH"] if env.get("PATH") else "")
    try:
        os.execve(path, [path] + sys.argv[1:], env)
    except OSError as e:
        sys.stderr.write("%s: cannot run %s: %s\n" % (TOOL_NAME, path, e))
        return 126


if __name__ == "__main__":
    sys.exit(main())
