"""Runs one vLLM engine (the offline LLM API, in this process) over a
checkpoint and writes what it generated as JSON. The serving tests and
bench/serve_bench.py start it in a fresh process per configuration, since
one process holds one vLLM engine.

  python serve_vllm_run.py SPEC.json OUT.json

SPEC: {"model": dir, "dtype": "float32"|"bfloat16", "kt": null | {options},
       "prompts": [[token ids], ...], "max_tokens": n,
       "prompt_logprobs": false | true (every vocabulary entry at every
       prompt position), "bench": null | {"decode_batches": [1, 8, 32],
       "decode_tokens": n, "prefill_tokens": n, "repeats": n},
       "llm": {extra LLM(...) arguments}}
OUT:  {"start_s": seconds to a ready engine (weights loaded), "tokens": [[ids]], "texts": [...], "prompt_logprobs": [[[...V]...]],
       "kt_stats": {layer: [forwards, tokens]}, "kt_loader": {"skipped": n,
       "through_vllm": n} (kt.integrations.vllm.loader_stats), "kt_stats_ranks"
       and "kt_loader_ranks" (the same, one a rank), "bench": {...}} or
      {"error": text} (exit status 1).

The kt plugin is registered explicitly (kt.integrations.vllm.register), as
vLLM's plugin loader does through the entry point where kt is installed;
with "kt": null the server is vLLM's alone.
"""
import json
import os
import sys
import time
import traceback


def _engine(spec):
    from vllm import LLM
    kw = dict(model=spec["model"], dtype=spec.get("dtype", "float32"), max_model_len=spec.get("max_model_len", 1024),
              enforce_eager=True, seed=0, gpu_memory_utilization=0.05, max_num_seqs=64,
              kv_cache_memory_bytes=256 << 20)
    if spec.get("prompt_logprobs"):
        kw["max_logprobs"] = -1
    if spec.get("kt") is not None:
        kw["additional_config"] = {"kt": spec["kt"]}
    kw.update(spec.get("llm") or {})
    return LLM(**kw)


def _prompts(ids_list):
    return [{"prompt_token_ids": list(ids)} for ids in ids_list]


def _bench(llm, spec, vocab):
    """tokens/s of decode at each batch size and of one long prefill."""
    from vllm import SamplingParams
    import random
    b = spec["bench"]
    rng = random.Random(0)
    rand = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    out = {}
    repeats = int(b.get("repeats", 2))
    # Prefill: one prompt of prefill_tokens, one token out (its time is the prefill).
    n = int(b["prefill_tokens"])
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(_prompts([rand(n)]), one, use_tqdm=False)  # warm-up
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate(_prompts([rand(n)]), one, use_tqdm=False)
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    out["prefill_%d" % n] = n / best
    # Decode: batch sequences of a short prompt, decode_tokens new tokens
    # each; the prefill of the short prompts is timed apart and subtracted.
    steps = int(b["decode_tokens"])
    for batch in b["decode_batches"]:
        prompts = [rand(8) for _ in range(batch)]
        gen = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        llm.generate(_prompts(prompts), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
        best = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            llm.generate(_prompts(prompts), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                         use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(_prompts(prompts), gen, use_tqdm=False)
            t2 = time.perf_counter()
            dt = (t2 - t1) - (t1 - t0)
            best = dt if best is None else min(best, dt)
        out["decode_%d" % batch] = batch * (steps - 1) / best
    return out


def main(spec_path, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import kt.integrations.vllm as ktv
        ktv.register()
        from vllm import SamplingParams
        started = time.perf_counter()
        llm = _engine(spec)
        result = {"start_s": time.perf_counter() - started}
        with open(os.path.join(spec["model"], "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        if spec.get("prompts"):
            sp = SamplingParams(temperature=0, max_tokens=int(spec.get("max_tokens", 16)),
                                prompt_logprobs=(vocab if spec.get("prompt_logprobs") else None))
            outs = llm.generate(_prompts(spec["prompts"]), sp, use_tqdm=False)
            result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            result["texts"] = [o.outputs[0].text for o in outs]
            if spec.get("prompt_logprobs"):
                rows = []
                for o in outs:
                    per = []
                    for pos in o.prompt_logprobs[1:]:  # the first position has none
                        v = [0.0] * vocab
                        for tok, lp in pos.items():
                            v[tok] = lp.logprob
                        per.append(v)
                    rows.append(per)
                result["prompt_logprobs"] = rows
        if spec.get("bench"):
            result["bench"] = _bench(llm, spec, vocab)
        # One entry a rank (tensor/expert parallel run several workers);
        # rank 0's is "kt_stats" and "kt_loader".
        stats = llm.apply_model(ktv.kt_stats)
        result["kt_stats"] = stats[0] if stats else {}
        result["kt_stats_ranks"] = stats or []
        loader = llm.apply_model(ktv.loader_stats)
        result["kt_loader"] = loader[0] if loader else {}
        result["kt_loader_ranks"] = loader or []
    except Exception as e:  # noqa: BLE001 - the test reads the reason
        with open(out_path, "w") as f:
            json.dump({"error": "%s: %s" % (type(e).__name__, e), "traceback": traceback.format_exc()}, f)
        return 1
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # vLLM's engine threads need not be waited for
