"""LlamaFactory with the routed experts of MoE models computed by kt.

Training starts from LlamaFactory's own YAML config, with this module in
place of ``llamafactory-cli``::

    llamafactory-cli train cfg.yaml                       # LlamaFactory alone
    python -m kt.integrations.llamafactory train cfg.yaml # the same, experts in kt

Overrides after the file work as with ``llamafactory-cli`` (``key=value``,
OmegaConf). kt's own options go in an optional ``kt:`` mapping of the same
YAML (or ``kt.threads=4`` on the command line), which is taken out before
LlamaFactory reads the config:

  precision       "auto" (default: kt keeps fp32 activations fp32 when the
                  model runs in float32, else kt's default), "default", "fp32"
  threads         kt worker threads (default 0: every CPU of the process)
  weight_format   how kt stores the frozen experts ("bf16" default,
                  "int8_channel", "int4_g32", "int4_g128"; see kt.hf)
  max_tokens      tokens per kt call (default 1024; longer batches are cut)
  activation_policy  "recompute" (default) or "retain" (see kt.hf)

Why a module and not a switch of ``llamafactory-cli``: LlamaFactory 0.9.5
has no plugin hook. Its parser rejects keys it does not know (unless
ALLOW_EXTRA_ARGS), nothing it runs imports a module named by the user, and
its own ``use_kt`` switch belongs to the KTransformers stack (it requires
the packages kt-kernel, transformers-kt and accelerate-kt). So this module
installs the hook in the process and then calls LlamaFactory's own train
entry, ``llamafactory.train.tuner.run_exp``, with the config it read by
LlamaFactory's own ``read_args`` (what ``llamafactory-cli train`` runs in a
single process). It always trains in this one process: kt computes the
experts on this process's CPUs, so the launcher's torchrun and Ray paths are
not taken.

The hook (``install``) replaces two names inside
``llamafactory.model.loader`` and ``llamafactory.model.adapter``:

* the model class ``load_model`` loads causal LMs with: the model is built
  from LlamaFactory's own (patched) config with its parameters on the meta
  device, every routed-experts block is kt's, and kt reads the expert
  weights straight from the checkpoint's safetensors files
  (``kt.hf.from_pretrained``); only attention, routers, shared experts,
  embeddings and norms become torch tensors. Then LlamaFactory goes on as
  usual: its patches, gradient checkpointing, PEFT's LoRA, its Trainer and
  optimizer, logging and saving.
* ``get_peft_model``, by ``kt.hf.get_peft_model`` (PEFT freezes every
  parameter that is not its own; kt's LoRA factors are made trainable again).

What kt trains follows LlamaFactory's LoRA config (``finetuning_type: lora``
only; freeze and full tuning are refused):

* ``lora_target: all`` gives LoRA to what LlamaFactory finds as linear
  modules. With transformers 5 (the pinned 5.6.0) the routed experts are
  fused parameters, not linear modules, so LlamaFactory's PEFT gives them no
  LoRA: with kt they stay frozen as well (kt computes their forward and the
  input gradients), and attention, shared experts and the rest get PEFT's
  LoRA exactly as without kt. With per-expert ``nn.Linear`` experts
  (transformers 4), ``all`` includes them, and kt gives them its LoRA on
  gate, up and down.
* A list that names expert projections (``gate_proj``, ``up_proj``,
  ``down_proj``, Mixtral's ``w1``/``w3``/``w2``, ``gate_up_proj``) gives
  kt's LoRA on those projections of the routed experts (``lora_rank``,
  ``lora_alpha``, ``lora_dropout``, ``use_rslora`` as given); PEFT applies
  the same names to the torch modules that have them (shared experts, dense
  layers). This is the one case where kt trains more than LlamaFactory alone
  on transformers 5, whose PEFT cannot reach fused experts by module name.
  The saved adapter (output_dir and every checkpoint-N) is then written by
  ``kt.hf.save_adapter``: one PEFT adapter with both parts, which PEFT loads
  onto the plain transformers model. (The fused experts' factors are written
  as the installed PEFT reads a 3-D parameter: PEFT 0.18, LlamaFactory's
  pin, reads [E, in, out] where later ones read transformers 5's
  [E, out, in]; ``peft_reads_3d_as_in_out``.)

After training, ``<output_dir>/kt_llamafactory.json`` says what kt did: the
kt blocks, their mode and LoRA targets, how many forward calls and tokens
they computed, and the engine.

A ``model_name_or_path`` that is not a local directory is fetched with
huggingface_hub first (kt reads the files). ``train_from_scratch`` is
refused (kt loads the experts from a checkpoint), and so is USE_RAY (Ray's
workers would not have the hook). The other stages (pt, dpo, ...) load the
model through the same ``load_model`` but only sft is tested; LlamaFactory's
``device_map`` is not applied by the hook, and only the CPU is tested.
Versions: packaging/python/requirements-llamafactory.txt.
"""
import json
import os
import sys

USAGE = "usage: python -m kt.integrations.llamafactory train CONFIG.yaml [key=value ...]"

_EXPERT_NAMES = {"gate_proj": ("gate",), "w1": ("gate",), "up_proj": ("up",), "w3": ("up",),
                 "down_proj": ("down",), "w2": ("down",), "gate_up_proj": ("gate", "up")}
_OPTIONS = ("precision", "threads", "weight_format", "max_tokens", "activation_policy")

# What the installed hook did, for the report and the adapter saves.
_state = {"options": {}, "finetuning": None, "blocks": [], "mode": None, "targets": (),
          "calls": 0, "tokens": 0, "engine": None, "model": None}


def _kt_targets(finetuning, per_expert):
    """(mode, kt LoRA projections) for LlamaFactory's finetuning arguments."""
    if finetuning is None:
        return "inference", ()
    if finetuning.finetuning_type != "lora":
        raise ValueError("kt.integrations.llamafactory: finetuning_type %r; kt trains the routed experts "
                         "with LoRA only (finetuning_type: lora)" % finetuning.finetuning_type)
    targets = list(finetuning.lora_target or [])
    if targets == ["all"]:
        projections = ("gate", "up", "down") if per_expert else ()
    else:
        projections = tuple(p for p in ("gate", "up", "down")
                            if any(p in _EXPERT_NAMES.get(t, ()) for t in targets))
    if projections and getattr(finetuning, "use_dora", False):
        raise ValueError("kt.integrations.llamafactory: use_dora on the routed experts; kt's LoRA is plain "
                         "LoRA (leave the expert projections out of lora_target)")
    return ("lora" if projections else "inference"), projections


def _experts_are_modules(config, trust_remote_code=False):
    """Whether the plain transformers model holds its routed experts as a
    list of per-expert modules (transformers 4) rather than fused parameters."""
    import torch
    import transformers
    from torch import nn
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return any(isinstance(getattr(m, "experts", None), nn.ModuleList) for m in model.modules())


def peft_reads_3d_as_in_out():
    """Whether the installed PEFT reads every 3-D parameter it targets as
    [E, in, out]. PEFT 0.18 (LlamaFactory 0.9.5's pin) does; later ones read
    [E, out, in] unless the experts module says ``is_transposed``, which
    kt.hf assumes. Asked of PEFT itself, on a [1, 2, 3] parameter."""
    import warnings

    import peft
    import torch

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1, 2, 3))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = peft.get_peft_model(Block(), peft.LoraConfig(r=1, target_modules=[],
                                                               target_parameters=["experts.w"]))
    return wrapped.base_model.model.experts.in_features == 2


def _resolve_dtype(config, requested):
    import torch
    if isinstance(requested, torch.dtype):
        return requested
    if requested in (None, "auto"):
        d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        return getattr(torch, d) if isinstance(d, str) else d
    return getattr(torch, requested)


def _local_directory(name, kwargs):
    if os.path.isdir(name):
        return name
    from huggingface_hub import snapshot_download
    return snapshot_download(name, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"),
                             token=kwargs.get("token"))


def _count(module, inputs, output):
    h = inputs[0] if inputs else None
    _state["calls"] += 1
    if h is not None and hasattr(h, "shape"):
        _state["tokens"] += int(h.numel() // h.shape[-1])


class KtCausalLM:
    """Stands in for transformers.AutoModelForCausalLM inside LlamaFactory's
    loader: from_pretrained loads with kt.hf (experts in kt)."""

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path, *args, config=None, torch_dtype=None, dtype=None,
                        **kwargs):
        import torch
        import transformers

        import kt
        import kt.hf
        if args:
            raise TypeError("kt.integrations.llamafactory: positional model arguments %r" % (args,))
        directory = _local_directory(os.fspath(pretrained_model_name_or_path), kwargs)
        if config is None:
            config = transformers.AutoConfig.from_pretrained(directory)
        dtype = _resolve_dtype(config, dtype if dtype is not None else torch_dtype)
        opts = dict(_state["options"])
        unknown = sorted(set(opts) - set(_OPTIONS))
        if unknown:
            raise ValueError("kt.integrations.llamafactory: unknown kt option(s) %s (known: %s)"
                             % (", ".join(unknown), ", ".join(_OPTIONS)))
        precision = opts.pop("precision", "auto")
        if precision == "auto":
            precision = "fp32" if dtype == torch.float32 else "default"
        engine = kt.Engine(num_threads=int(opts.pop("threads", 0)), precision=precision)
        finetuning = _state["finetuning"]
        # The plain model's expert form decides what lora_target "all" means.
        rng = torch.random.get_rng_state()
        remote = bool(kwargs.get("trust_remote_code", False))
        per_expert = _experts_are_modules(config, remote)
        mode, projections = _kt_targets(finetuning, per_expert)
        lora = {}
        if mode == "lora":
            lora = dict(lora_rank=finetuning.lora_rank, lora_alpha=float(finetuning.lora_alpha),
                        lora_dropout=float(finetuning.lora_dropout), use_rslora=bool(finetuning.use_rslora),
                        target_modules=list(projections))

        class _WithConfig:
            # LlamaFactory's config (its attention, MoE and cache patches),
            # not the one kt.hf would read from the directory again.
            @staticmethod
            def from_config(_config, **kw):
                return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=remote, **kw)

        model = kt.hf.from_pretrained(directory, model_class=_WithConfig, dtype=dtype, engine=engine,
                                      mode=mode, **lora, **opts)
        # transformers' from_pretrained draws no random numbers for a
        # checkpoint that holds every tensor; neither does this load, so
        # PEFT's LoRA initialisation that follows is the same.
        torch.random.set_rng_state(rng)
        blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, kt.torch.MoEExperts)]
        if mode == "lora" and peft_reads_3d_as_in_out():
            # The saved adapter in the form this PEFT loads onto the plain
            # model (kt.hf's save_adapter follows the block's peft_in_out).
            for _, m in blocks:
                if hasattr(m, "peft_in_out"):
                    m.peft_in_out = True
        for _, m in blocks:
            m.register_forward_hook(_count)
        _state.update(blocks=[n for n, _ in blocks], mode=mode, targets=projections, engine=engine.info())
        print("kt.integrations.llamafactory: %d routed-experts blocks in kt (%s%s), engine %s/%s" % (
            len(blocks), mode, ", LoRA on " + "/".join(projections) if projections else ", frozen",
            engine.info()["isa"], precision), file=sys.stderr)
        return model

    @staticmethod
    def from_config(*args, **kwargs):
        raise ValueError("kt.integrations.llamafactory: train_from_scratch has no checkpoint for kt to load "
                         "the experts from")


def _get_peft_model(model, peft_config, *args, **kwargs):
    import kt.hf
    targets = peft_config.target_modules
    if isinstance(targets, (list, set, tuple)) and _state["mode"] == "lora":
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        if not names & set(targets):
            raise ValueError("kt.integrations.llamafactory: lora_target %s names only the routed experts, "
                             "which kt trains; PEFT needs at least one torch module too (e.g. q_proj,v_proj)"
                             % ",".join(sorted(targets)))
    return kt.hf.get_peft_model(model, peft_config, *args, **kwargs)


def _callback():
    from transformers import TrainerCallback

    class KtCallback(TrainerCallback):
        """Keeps the trained model, writes kt's adapter into each checkpoint
        and the report at the end."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            _state["model"] = model

        def on_save(self, args, state, control, model=None, **kwargs):
            if _state["mode"] == "lora" and state.is_world_process_zero:
                directory = os.path.join(args.output_dir, "checkpoint-%d" % state.global_step)
                if os.path.isdir(directory):
                    save_adapter(model or _state["model"], directory)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if model is not None:
                _state["model"] = model
            if state.is_world_process_zero:
                write_report(args.output_dir)

    return KtCallback()


def save_adapter(model, directory):
    """kt's experts' LoRA and PEFT's, as one PEFT adapter in directory."""
    import kt.hf
    model = getattr(model, "module", model)
    kt.hf.save_adapter(model, directory, base_model=getattr(getattr(model, "config", None), "_name_or_path", None))


def write_report(directory):
    os.makedirs(directory, exist_ok=True)
    report = {k: _state[k] for k in ("blocks", "mode", "calls", "tokens", "engine")}
    report["lora_targets"] = list(_state["targets"])
    with open(os.path.join(directory, "kt_llamafactory.json"), "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def _finetuning_arguments(args):
    from transformers import HfArgumentParser
    from llamafactory.hparams import FinetuningArguments
    parser = HfArgumentParser(FinetuningArguments)
    if isinstance(args, dict):
        return parser.parse_dict(args, allow_extra_keys=True)[0]
    return parser.parse_args_into_dataclasses(args=list(args), return_remaining_strings=True)[0]


def install(options=None, finetuning=None):
    """Puts kt into this process's LlamaFactory: causal LMs that
    llamafactory.model.load_model loads get their routed experts in kt, with
    ``options`` (the ``kt:`` mapping) and what LlamaFactory's
    ``finetuning`` arguments (FinetuningArguments) ask for the experts."""
    import llamafactory.model.adapter as adapter
    import llamafactory.model.loader as loader
    _state["options"] = dict(options or {})
    _state["finetuning"] = finetuning
    loader.AutoModelForCausalLM = KtCausalLM
    adapter.get_peft_model = _get_peft_model


def train(argv):
    """``llamafactory-cli train ARGV...`` in this process, with kt."""
    if os.environ.get("USE_RAY", "0").lower() in ("true", "y", "1"):
        raise ValueError("kt.integrations.llamafactory: USE_RAY would train in Ray's workers, without kt; "
                         "kt trains in this one process")
    sys.argv = [sys.argv[0]] + list(argv)
    from llamafactory.hparams import read_args
    from llamafactory.train.tuner import run_exp
    args = read_args()
    options = {}
    if isinstance(args, dict):
        options = args.pop("kt", None) or {}
        if not isinstance(options, dict):
            raise ValueError("kt.integrations.llamafactory: 'kt' must be a mapping of kt options")
    install(options, _finetuning_arguments(args))
    run_exp(args, callbacks=[_callback()])
    model = _state["model"]
    output_dir = args.get("output_dir") if isinstance(args, dict) else None
    if _state["mode"] == "lora" and model is not None and output_dir:
        # After LlamaFactory's own save (PEFT's part only): both parts.
        save_adapter(model, output_dir)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "train":
        print("kt.integrations.llamafactory: only 'train' runs with kt; %r is llamafactory-cli's (an adapter "
              "saved here loads with PEFT on the plain model)\n%s" % (argv[0], USAGE), file=sys.stderr)
        return 2
    train(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
