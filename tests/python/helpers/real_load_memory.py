"""Run as a program: loads a checkpoint directory with kt.hf.from_pretrained
("kt") or transformers' from_pretrained ("transformers") in fp32 and prints,
as JSON, the process's peak resident memory before and after the load
(VmHWM, reset before the load) and the bytes of the torch tensors the model holds."""
import json
import sys

import torch
import transformers  # noqa: F401  (imported before the baseline is taken)

import kt
import kt.hf


def resident():
    """(current, peak) resident bytes of this process."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    kib = lambda k: int(fields[k].split()[0]) * 1024  # noqa: E731
    return kib("VmRSS"), kib("VmHWM")


def reset_peak():
    """Linux resets the peak (VmHWM) to the current RSS on "5" in clear_refs,
    so the peak that follows is the load's own and not the imports'."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(directory, how):
    # The model's modules are imported lazily: build it once on the meta
    # device first, so the baseline holds the code and only the load is
    # measured.
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)
    torch.ones(16).sum()
    # kt's engine (its worker threads and their stacks) is made once per
    # process, not per load.
    kt.default_engine()
    reset_peak()
    before, _ = resident()
    if how == "kt":
        model = kt.hf.from_pretrained(directory, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    _, after = resident()
    held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    experts = kt.hf.kt_experts_modules(model)
    print(json.dumps({"before": before, "after": after, "torch_bytes": held,
                      "kt_blocks": len(experts)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
