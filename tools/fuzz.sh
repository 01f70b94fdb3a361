#!/bin/sh
# Builds the libFuzzer targets of kt's file readers (clang, ASan + UBSan) in
# build-fuzz/ and runs each one for SECONDS (default 60), one after another,
# on the seeds kt's writers make plus the committed corpora. New inputs go to
# build-fuzz/tests/io/fuzz/corpus/<target>; a crash leaves its input in
# build-fuzz/tests/io/fuzz/artifacts/ and stops the script (commit a minimized one under
# tests/io/fuzz/regressions/<target>/ with the fix).
# The target vllm_options is the structured fuzzer of the vLLM plugin's
# options (tests/python/helpers/option_fuzz.py), run by $KT_FUZZ_PYTHON
# (default /usr/bin/python3, which has torch) on the libkt kt's Python plugin
# finds ($KT_LIBRARY, or the build tree's).
#   usage: tools/fuzz.sh [SECONDS] [TARGET ...]
#   (targets: header index layout adapter packed quant optim dist_ckpt vllm_options)
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
[ $# -gt 0 ] && shift
targets=${*:-header index layout adapter packed quant optim dist_ckpt vllm_options}
build=${KT_FUZZ_BUILD:-$root/build-fuzz}
CC=clang CXX=clang++ cmake -S "$root" -B "$build" -DKT_BUILD_FUZZERS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j"${KT_FUZZ_JOBS:-2}"
fuzz="$build/tests/io/fuzz"
"$fuzz/kt_fuzz_seeds" "$fuzz/seeds"
for t in $targets; do
  if [ "$t" = vllm_options ]; then
    echo "== vllm_options: $seconds s"
    PYTHONPATH="$root/plugins/python:$root/tests/python${PYTHONPATH:+:$PYTHONPATH}" \
      "${KT_FUZZ_PYTHON:-/usr/bin/python3}" "$root/tests/python/helpers/option_fuzz.py" --seconds "$seconds"
    continue
  fi
  dirs="$fuzz/corpus/$t $fuzz/seeds/$t"
  [ -d "$root/tests/io/fuzz/regressions/$t" ] && dirs="$dirs $root/tests/io/fuzz/regressions/$t"
  [ "$t" = header ] && dirs="$dirs $root/tests/io/fuzz_corpus"
  mkdir -p "$fuzz/corpus/$t" "$fuzz/artifacts"
  echo "== kt_fuzz_$t: $seconds s"
  "$fuzz/kt_fuzz_$t" -max_total_time="$seconds" -rss_limit_mb=2048 -max_len=65536 -timeout=10 \
      -print_final_stats=1 -artifact_prefix="$fuzz/artifacts/$t-" $dirs > "$fuzz/fuzz-$t.log" 2>&1 || {
    tail -40 "$fuzz/fuzz-$t.log"
    echo "kt_fuzz_$t failed; the log is $fuzz/fuzz-$t.log" >&2
    exit 1
  }
  # The coverage reached (cov: edges, ft: features, corp: corpus) and the runs.
  grep -E "cov: " "$fuzz/fuzz-$t.log" | tail -1
  grep -E "^Done [0-9]+ runs" "$fuzz/fuzz-$t.log" || tail -3 "$fuzz/fuzz-$t.log"
done
