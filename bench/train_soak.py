#!/usr/bin/env python3
"""LoRA training through transformers.Trainer with kt's experts under
injected faults: every resume must continue with the bits of a run that
went through.

The run: a small random-weight Qwen3-MoE (tests/python/helpers/
real_models.py, written once per invocation), its routed experts in kt
(kt.hf.from_pretrained, LoRA on down_proj, fp32 engine, one thread), PEFT's
LoRA on q_proj and v_proj (kt.hf.get_peft_model), kt.optim.AdamW, fp32, a
fixed synthetic token dataset, --steps optimizer steps, a checkpoint every
--save-every steps (save_total_limit 2) with kt.integrations.trainer's
CompleteCheckpoints recording each complete one. Every training run is a
child process (this script in --worker mode).

A reference run goes through once, keeping all its checkpoints; its trained
parameters, optimizer state and loss of each step are the bits every resumed
run must end with. Then faults are drawn in rounds, every kind once a round
in a seeded order, each at a seeded random point, until --minutes are up
(checked between rounds) or --faults are done:

  kill_in_save   the child stops in the middle of writing one file of a
                 checkpoint (adapter, kt's experts' factors, optimizer.pt,
                 scheduler.pt, trainer_state.json, or just before kt's
                 completeness record) and is killed with SIGKILL;
  enospc         the output folder is a tmpfs too small for the run's
                 checkpoints: a save fails, the run must stop with the error
                 of a full disk; the complete checkpoints are copied to a
                 larger folder (skipped, with the reason, where mount fails);
  corrupt        a file of the newest checkpoint has a byte flipped or is
                 truncated: kt.integrations.trainer must refuse the folder
                 naming the file; a resume from it anyway records what the
                 readers (torch, safetensors, kt) say;
  corrupt_packed a kt packed cache of the model's first MoE layer
                 (MoE.save_packed) has a byte flipped or is truncated: kt
                 must refuse to load it naming the file, or load the same
                 weights (the layer's output bit-identical; the training
                 run itself reads the checkpoint, not a packed cache);
  nan_grad       one gradient element of one trainable tensor is set to NaN
                 or inf after Trainer's clipping, before the optimizer step:
                 kt.optim must skip that step leaving every parameter and
                 every state tensor as it was, and the run must go on;
  rank_killed    in a 2-rank expert-parallel run (kt.dist over
                 torch.distributed gloo: one kt LoRA layer, kt's
                 LayerOptimizer, a plain loop, a kt distributed checkpoint
                 every --save-every steps), rank 1 kills itself (SIGKILL)
                 between a forward and its backward: rank 0 must fail with an
                 error within 3 x the communicator's timeout (5 s), not hang;
                 both ranks then resume from the newest checkpoint and must
                 end with the bits of a 2-rank run that went through (LoRA
                 factors, the loss of each step, and every tensor of the
                 final checkpoint, optimizer state included). Skipped, with
                 the reason, where kt was built without Gloo (the pip wheel).

After kill_in_save, enospc and corrupt the partial or damaged folder must be
refused, the newest complete checkpoint is taken
(last_complete_checkpoint), a new child resumes from it to --steps and its
parameters, optimizer state and the loss of every step after the resume
must equal the reference's bit for bit (compared as bytes).

Reported (stdout, --json): faults injected and survived per kind, resumes,
optimizer steps trained (Trainer runs, and the 2-rank loop's), the refusals
and error messages seen, wall time, the CPU (model name, AVX-512/AMX
flags). Exit status 1 if a fault was not survived.

  bench/train_soak.py [--minutes 10] [--faults N] [--seed 0] [--steps 8]
                      [--save-every 2] [--kinds K1,K2] [--keep] [--json out.json]

Needs transformers, peft and mount(8) rights for enospc (root).
"""
import argparse
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests", "python")
PLUGIN = os.path.join(ROOT, "plugins", "python")

KINDS = ("kill_in_save", "enospc", "corrupt", "corrupt_packed", "nan_grad", "rank_killed")
# The files a kill can land in the middle of; "record" is kt's completeness
# record, killed before it is written.
KILL_FILES = ("adapter_model.safetensors", "kt_experts_lora.safetensors", "optimizer.pt", "scheduler.pt",
              "trainer_state.json", "record")
CORRUPT_FILES = ("adapter_model.safetensors", "kt_experts_lora.safetensors", "optimizer.pt", "scheduler.pt",
                 "rng_state.pth", "trainer_state.json")
BATCH, LENGTH, SAMPLES, RANK = 2, 12, 32, 4
CHILD_TIMEOUT = 600


# ------------------------------------------------------------------ worker

def _worker(spec):
    """One training run in this process, as the spec says; writes its result
    (or its error) to spec["result"]."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    torch.set_num_threads(1)
    import peft
    import transformers
    import kt
    import kt.hf
    import kt.optim
    from kt.integrations import trainer as kt_trainer

    fault = spec.get("fault") or {}
    if fault.get("kind") == "kill_in_save":
        _arm_kill_in_save(fault, torch)

    # PEFT's and kt's LoRA factors start random: the same start in every
    # child (Trainer seeds only after the model exists).
    transformers.set_seed(0)
    engine = kt.Engine(num_threads=1, pin_threads=False, precision="fp32")
    model = kt.hf.from_pretrained(spec["model_dir"], dtype=torch.float32, engine=engine, mode="lora",
                                  lora_rank=RANK, lora_alpha=2 * RANK, target_modules=["down_proj"])
    model = kt.hf.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK,
                                                         target_modules=["q_proj", "v_proj"]))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = kt.optim.AdamW([p for _, p in named], lr=1e-2, weight_decay=0.01)
    losses, nan_report = {}, {}

    class LossRecordingTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            value = loss[0] if isinstance(loss, tuple) else loss
            losses[self.state.global_step + 1] = value.detach().clone()
            return loss

    callbacks = [kt_trainer.CompleteCheckpoints()]
    if fault.get("kind") == "nan_grad":
        callbacks.append(_nan_callback(fault, named, optimizer, nan_report, torch, transformers))
    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, spec["vocab"], (SAMPLES, LENGTH), generator=g)
    data = [{"input_ids": t, "labels": t.clone(), "attention_mask": torch.ones_like(t)} for t in tokens]
    args = transformers.TrainingArguments(
        output_dir=spec["output_dir"], per_device_train_batch_size=BATCH, max_steps=spec["steps"],
        learning_rate=1e-2, lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=1.0,
        report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0, save_strategy="steps",
        save_steps=spec["save_every"], save_total_limit=spec.get("save_total_limit"), disable_tqdm=True,
        logging_strategy="no")
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None),
                                   callbacks=callbacks)
    result = {}
    try:
        trainer.train(resume_from_checkpoint=spec.get("resume"))
        state = optimizer.state_dict()["state"]
        result.update(params={n: p.detach().clone() for n, p in named}, state=state, losses=losses,
                      global_step=trainer.state.global_step, nan=nan_report)
    except Exception as e:  # the parent judges the error
        result["error"] = "%s: %s" % (type(e).__name__, e)
    buf = io.BytesIO()
    torch.save(result, buf)
    with open(spec["result"] + ".tmp", "wb") as f:
        f.write(buf.getvalue())
    os.replace(spec["result"] + ".tmp", spec["result"])
    return 1 if "error" in result else 0


def _halt(path, data, ready):
    """Writes the first half of data to path, tells the parent, and waits
    for its SIGKILL: the kill lands in the middle of the file."""
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
    with open(ready, "w") as f:
        f.write(path)
    while True:
        time.sleep(60)


def _arm_kill_in_save(fault, torch):
    """Wraps the writer of fault["file"] so that it halts half-way at the
    save of checkpoint-<fault["step"]>."""
    where, name, ready = "checkpoint-%d" % fault["step"], fault["file"], fault["ready"]

    def hit(path):
        return where in str(path) and os.path.basename(str(path)).endswith(name)

    if name in ("optimizer.pt", "scheduler.pt"):
        original = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and hit(f):
                buf = io.BytesIO()
                original(obj, buf, *args, **kwargs)
                _halt(f, buf.getvalue(), ready)
            return original(obj, f, *args, **kwargs)
        torch.save = save
    elif name == "adapter_model.safetensors":
        import peft.peft_model
        import safetensors.torch
        original = peft.peft_model.safe_save_file

        def safe_save_file(tensors, filename, metadata=None):
            if hit(filename):
                _halt(filename, safetensors.torch.save(tensors, metadata=metadata), ready)
            return original(tensors, filename, metadata=metadata)
        peft.peft_model.safe_save_file = safe_save_file
    elif name == "kt_experts_lora.safetensors":
        from kt import _safetensors
        original = _safetensors.write_atomic

        def write_atomic(path, data):
            if hit(path):
                # As the atomic writer does: a temporary name, renamed after.
                tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".partial")
                _halt(tmp, b"".join(data), ready)
            return original(path, data)
        _safetensors.write_atomic = write_atomic
    elif name == "trainer_state.json":
        from transformers.trainer_callback import TrainerState
        original = TrainerState.save_to_json

        def save_to_json(self, json_path):
            if hit(json_path):
                import dataclasses
                text = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"
                _halt(json_path, text.encode(), ready)
            return original(self, json_path)
        TrainerState.save_to_json = save_to_json
    else:
        from kt.integrations import trainer as kt_trainer
        original = kt_trainer.write_record

        def write_record(directory, global_step):
            if where in directory:
                _halt(os.path.join(directory, ".record-not-written"), b"", ready)
            return original(directory, global_step)
        kt_trainer.write_record = write_record


def _nan_callback(fault, named, optimizer, report, torch, transformers):
    """Poisons one gradient element at fault["step"] after Trainer's clipping
    and checks that the optimizer step left every parameter and state
    tensor as it was."""
    name, value = named[fault["param"] % len(named)][0], float(fault["value"])

    def snapshot():
        state = optimizer.state_dict()["state"]
        return [_raw(p) for _, p in named] + [_raw(t) for i in sorted(state) for _, t in sorted(state[i].items())]

    class PoisonGradient(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step + 1 == fault["step"]:
                p = dict(named)[name]
                flat = p.grad.view(-1)
                flat[fault["element"] % flat.numel()] = value
                report.update(param=name, value=fault["value"], before=snapshot())

        def on_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step + 1 == fault["step"]:
                after = snapshot()
                before = report.pop("before")
                report["unchanged"] = after == before
                report["changed"] = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
                report["tensors_compared"] = len(after)

    return PoisonGradient()


def _raw(t):
    """The bytes of a tensor (a bit comparison, NaN-safe), with its dtype and
    shape."""
    import torch
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return (str(t.dtype), tuple(t.shape), t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())


# The expert-parallel run of rank_killed: one kt.dist LoRA layer over 2 ranks.
DIST_E, DIST_K, DIST_H, DIST_I, DIST_R, DIST_TOKENS = 8, 2, 32, 24, 4, 6
COMM_TIMEOUT = 5.0


def _rank_worker(spec):
    """One rank of a 2-rank expert-parallel run (kt.dist, gloo): a plain
    loop of forward, MSE loss, backward and kt's LayerOptimizer step, a kt
    distributed checkpoint (published atomically) every save_every steps.
    The rank spec["kill_rank"] kills itself with SIGKILL between the forward
    and the backward of spec["kill_step"]."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    import kt
    from kt.dist import Communicator, DistMoE, LayerOptimizer, load_checkpoint, save_checkpoint

    rank, E, K, H, I, R, T = spec["rank"], DIST_E, DIST_K, DIST_H, DIST_I, DIST_R, DIST_TOKENS
    dist.init_process_group("gloo", init_method="file://" + spec["init"], rank=rank, world_size=2)
    result, started = {"losses": {}}, None
    try:
        g = torch.Generator().manual_seed(11)
        weights = {"gate": torch.randn(E, I, H, generator=g) * 0.2, "up": torch.randn(E, I, H, generator=g) * 0.2,
                   "down": torch.randn(E, H, I, generator=g) * 0.2}
        lora = {"LORA_%s_%s" % (ab, p): torch.randn(E, *shape, generator=g) * 0.1
                for p, shapes in (("GATE", ((R, H), (I, R))), ("UP", ((R, H), (I, R))), ("DOWN", ((R, I), (H, R))))
                for ab, shape in zip("AB", shapes)}
        comm = Communicator.from_process_group(timeout=COMM_TIMEOUT)
        layer = DistMoE(comm, E, K, H, I, max_tokens=T, mode="expert_parallel", grad_average="mean",
                        layer_mode="lora", lora_rank=R, lora_alpha=2.0 * R,
                        engine=kt.Engine(num_threads=1, pin_threads=False, precision="fp32"))
        sel = torch.tensor(layer.local_experts(), dtype=torch.int64)
        layer.layer.load_weights(**{k: v[sel].contiguous() for k, v in weights.items()})
        params = {k: v[sel].clone() for k, v in lora.items()}
        layer.layer.bind(**params, **{"GRAD_" + k: torch.zeros_like(v) for k, v in params.items()})
        opt = LayerOptimizer(layer.layer, lr=1e-2)
        if spec["resume"]:
            load_checkpoint(comm, spec["resume"], {0: (layer, opt)})
        for step in range(opt.steps + 1, spec["steps"] + 1):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, target = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
            top = torch.randn(T, E, generator=g).topk(K)
            ids, route = top.indices.to(torch.int64).contiguous(), top.values.softmax(-1).contiguous()
            y = torch.empty_like(x)
            ctx = layer.forward(x, ids, route, y, save=True)
            if step == spec.get("kill_step") and rank == spec.get("kill_rank"):
                os.kill(os.getpid(), signal.SIGKILL)
            loss = ((y - target) ** 2).mean()
            started = time.time()
            layer.backward(ctx, (2.0 / y.numel()) * (y - target))
            ctx.release()
            opt.step()
            started = None
            result["losses"][step] = loss
            if step % spec["save_every"] == 0:
                save_checkpoint(comm, os.path.join(spec["checkpoints"], "step-%d" % step), {0: (layer, opt)})
        result["params"] = params
        result["experts"] = sel
    except Exception as e:  # the parent judges the error
        result["error"] = "%s: %s" % (type(e).__name__, e)
        if started is not None:
            result["error_after_s"] = round(time.time() - started, 2)
    torch.save(result, spec["result"] + ".tmp")
    os.replace(spec["result"] + ".tmp", spec["result"])
    if "error" in result:
        os._exit(1)  # the process group's peer is gone: no orderly shutdown
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ parent

class Soak:
    def __init__(self, args, scratch):
        self.args, self.scratch = args, scratch
        self.rng = random.Random(args.seed)
        self.counter = 0
        self.packed_layer = None  # the kt layer that loads the damaged packed caches
        self.dist_reference = None  # the two ranks' results of the run that went through
        self.report = {"injected": {k: 0 for k in KINDS}, "survived": {k: 0 for k in KINDS},
                       "skipped": {}, "resumes": 0, "steps_trained": 0, "rank_steps_trained": 0,
                       "refusals": [], "errors": [],
                       "failures": [], "faults": []}

    def child(self, output_dir, resume=None, fault=None, save_total_limit=2, wait=True):
        """Starts a worker; returns its result (wait) or the Popen and the
        result path."""
        self.counter += 1
        result = os.path.join(self.scratch, "result-%d.pt" % self.counter)
        spec = {"model_dir": self.model_dir, "vocab": self.vocab, "output_dir": output_dir,
                "steps": self.args.steps, "save_every": self.args.save_every, "resume": resume,
                "fault": fault, "result": result, "save_total_limit": save_total_limit}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([PLUGIN, TESTS, os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        log = open(os.path.join(self.scratch, "child-%d.log" % self.counter), "wb")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        if not wait:
            return proc, result
        proc.wait(timeout=CHILD_TIMEOUT)
        return self.result(result, proc.returncode)

    def result(self, path, returncode):
        import torch
        if not os.path.exists(path):
            return {"error": "the worker exited with status %s and no result (log: %s)" % (
                returncode, path.replace("result-", "child-").replace(".pt", ".log"))}
        out = torch.load(path, weights_only=False)
        if "global_step" in out:
            self.report["steps_trained"] += len(out["losses"])
        return out

    def setup(self):
        sys.path.insert(0, TESTS)
        from helpers import real_models
        self.model_dir = os.path.join(self.scratch, "model")
        real_models.save("qwen3_moe", self.model_dir)
        self.vocab = real_models.VOCAB
        self.reference_dir = os.path.join(self.scratch, "reference")
        self.reference = self.child(self.reference_dir, save_total_limit=None)
        if "error" in self.reference:
            raise RuntimeError("the reference run failed: " + self.reference["error"])
        self.saves = list(range(self.args.save_every, self.args.steps + 1, self.args.save_every))

    # The bit comparison of a resumed run with the reference.
    def matches(self, got, resumed_at, what):
        if "error" in got:
            return self.fail(what, "the resumed run failed: " + got["error"])
        ref = self.reference
        diffs = [n for n in ref["params"] if _raw(ref["params"][n]) != _raw(got["params"].get(n))]
        diffs += ["optimizer state %s.%s" % (i, k) for i in ref["state"] for k in ref["state"][i]
                  if _raw(ref["state"][i][k]) != _raw(got["state"].get(i, {}).get(k))]
        steps = sorted(got["losses"])
        if steps != list(range(resumed_at + 1, self.args.steps + 1)):
            diffs.append("steps trained %s" % steps)
        diffs += ["loss of step %d" % s for s in steps if _raw(got["losses"][s]) != _raw(ref["losses"][s])]
        if diffs:
            return self.fail(what, "differs from the reference: " + ", ".join(diffs[:8]))
        self.report["resumes"] += 1
        return True

    def fail(self, what, message):
        self.report["failures"].append("%s: %s" % (what, message))
        return False

    def resume_and_compare(self, output_dir, what):
        """Checks that a partial/damaged checkpoint is passed over, then
        resumes from the newest complete one and compares."""
        from kt.integrations import trainer as kt_trainer
        refusals = []
        resume = kt_trainer.last_complete_checkpoint(output_dir, refusals)
        self.report["refusals"] += refusals
        at = int(resume.rsplit("-", 1)[1]) if resume else 0
        got = self.child(output_dir, resume=resume)
        return self.matches(got, at, what), refusals, resume

    # -------------------------------------------------------------- faults
    def kill_in_save(self, where):
        step, name = self.rng.choice(self.saves), self.rng.choice(KILL_FILES)
        ready = os.path.join(where, "ready")
        output_dir = os.path.join(where, "out")
        what = "kill_in_save checkpoint-%d %s" % (step, name)
        proc, result = self.child(output_dir, fault={"kind": "kill_in_save", "step": step, "file": name,
                                                     "ready": ready}, wait=False)
        deadline = time.time() + CHILD_TIMEOUT
        while not os.path.exists(ready) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if not os.path.exists(ready):
            proc.kill()
            proc.wait()
            return what, self.fail(what, "the save never reached %s (status %s)" % (name, proc.returncode))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        ok, refusals, resume = self.resume_and_compare(output_dir, what)
        partial = os.path.join(output_dir, "checkpoint-%d" % step)
        if ok and not any(partial in r for r in refusals):
            ok = self.fail(what, "the partial %s was not refused (refusals: %s)" % (partial, refusals))
        return what, ok

    def enospc(self, where):
        # A tmpfs holding the checkpoints kept at once (2, and the one being
        # written before the oldest goes) less a part of one: a save fails.
        ref = os.path.join(self.reference_dir, "checkpoint-%d" % self.saves[0])
        pages = sum(-(-os.path.getsize(os.path.join(ref, f)) // 4096) for f in os.listdir(ref))
        fits = self.rng.choice([1, 2]) if len(self.saves) > 2 else 1
        kib = (fits * pages + self.rng.randint(1, pages - 1)) * 4
        small = os.path.join(where, "small")
        os.makedirs(small)
        what = "enospc %d KiB (%d checkpoint(s) fit)" % (kib, fits)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%dk" % kib, "tmpfs", small],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            reason = "mount -t tmpfs failed: %s" % (mounted.stderr.strip() or mounted.returncode)
            self.report["skipped"]["enospc"] = reason
            return what, None
        try:
            got = self.child(small)
            error = got.get("error")
            if not error:
                return what, self.fail(what, "the run finished on a full disk")
            # What the writers say is recorded: torch.save's error names
            # neither the file nor the full disk.
            self.report["errors"].append({"fault": what, "error": error[:300],
                                          "says_no_space": "No space left on device" in error,
                                          "names_a_file": "checkpoint-" in error})
            large = os.path.join(where, "large")
            os.makedirs(large)
            from kt.integrations import trainer as kt_trainer
            for path in kt_trainer.checkpoints(small):
                shutil.copytree(path, os.path.join(large, os.path.basename(path)))
        finally:
            subprocess.run(["umount", small], check=True)
        ok, refusals, _ = self.resume_and_compare(large, what)
        if ok and not refusals:
            ok = self.fail(what, "no partial checkpoint was refused")
        return what, ok

    def damage(self, path, how):
        """Flips one bit of a random byte of path or truncates it there;
        returns (offset, size)."""
        size = os.path.getsize(path)
        at = self.rng.randrange(size)
        if how == "flip":
            with open(path, "r+b") as f:
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ (1 << self.rng.randrange(8))]))
        else:
            os.truncate(path, at)
        return at, size

    def corrupt(self, where):
        from kt.integrations import trainer as kt_trainer
        step = self.rng.choice(self.saves[1:] or self.saves)
        name, damage = self.rng.choice(CORRUPT_FILES), self.rng.choice(["flip", "truncate"])
        output_dir = os.path.join(where, "out")
        for s in self.saves:
            if s <= step:
                shutil.copytree(os.path.join(self.reference_dir, "checkpoint-%d" % s),
                                os.path.join(output_dir, "checkpoint-%d" % s))
        latest = os.path.join(output_dir, "checkpoint-%d" % step, name)
        at, size = self.damage(latest, damage)
        what = "corrupt %s of checkpoint-%d at byte %d/%d (%s)" % (name, step, at, size, damage)
        try:
            kt_trainer.verify_checkpoint(os.path.dirname(latest))
            return what, self.fail(what, "kt.integrations.trainer took the damaged checkpoint as complete")
        except kt_trainer.IncompleteCheckpointError as e:
            if latest not in str(e):
                return what, self.fail(what, "the refusal does not name %s: %s" % (latest, e))
        # What the readers themselves say when the folder is resumed from
        # without the check (in a copy: the resume writes checkpoints).
        unchecked = os.path.join(where, "unchecked")
        shutil.copytree(output_dir, unchecked)
        got = self.child(unchecked, resume=os.path.join(unchecked, "checkpoint-%d" % step))
        self.report["errors"].append({"fault": what, "unchecked_resume": got.get("error", "loaded without an error")
                                      [:300], "names_a_file": name in got.get("error", "")})
        ok, refusals, resume = self.resume_and_compare(output_dir, what)
        return what, ok

    def corrupt_packed(self, where):
        """A kt packed cache of the model's first MoE layer (kt's own format,
        checksummed), damaged: loading it must be refused naming it."""
        import kt
        import kt.hf
        import torch
        if self.packed_layer is None:
            model = kt.hf.from_pretrained(self.model_dir, dtype=torch.float32,
                                          engine=kt.Engine(num_threads=1, pin_threads=False))
            self.packed_layer = kt.hf.kt_experts_modules(model)[0].kt_layer
            self.packed_layer.save_packed(os.path.join(self.scratch, "layer0.ktpack"))
            self.packed_output = self.packed_forward()
        path = os.path.join(where, "layer0.ktpack")
        shutil.copy(os.path.join(self.scratch, "layer0.ktpack"), path)
        how = self.rng.choice(["flip", "truncate"])
        at, size = self.damage(path, how)
        what = "corrupt packed cache layer0.ktpack at byte %d/%d (%s)" % (at, size, how)
        try:
            self.packed_layer.load_packed(path)
        except kt.KtError as e:
            self.report["refusals"].append(str(e))
            if path not in str(e):
                return what, self.fail(what, "the refusal does not name %s: %s" % (path, e))
            return what, True
        # Loaded: only harmless if the damage changed no weight (kt's
        # checksums cover the sections, not the padding between them).
        if _raw(self.packed_forward()) != _raw(self.packed_output):
            return what, self.fail(what, "kt loaded the damaged packed cache without an error, other weights")
        self.report["errors"].append({"fault": what, "loaded": "without an error, the same weights (the "
                                      "layer's output bit-identical): an unchecked byte"})
        return what + " (unchecked byte, same weights)", True

    def packed_forward(self):
        import torch
        g = torch.Generator().manual_seed(5)
        layer = self.packed_layer
        x = torch.randn(16, layer.hidden, generator=g)
        ids = torch.stack([torch.randperm(layer.num_experts, generator=g)[:2] for _ in range(16)])
        y = torch.empty_like(x)
        layer.forward(x, ids, torch.rand(16, 2, generator=g), y)
        return y

    def ranks(self, where, resume=None, kill_step=None):
        """Runs the two ranks; returns their results, the rank 1 exit
        status and whether rank 0 ended within its bound."""
        self.counter += 1
        procs, results = [], []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([PLUGIN, TESTS, os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        for rank in (0, 1):
            result = os.path.join(self.scratch, "result-%d-rank%d.pt" % (self.counter, rank))
            spec = {"rank": rank, "init": os.path.join(where, "init-%d" % self.counter), "steps": self.args.steps,
                    "save_every": self.args.save_every, "checkpoints": os.path.join(where, "checkpoints"),
                    "resume": resume, "kill_step": kill_step, "kill_rank": 1, "result": result}
            log = open(os.path.join(self.scratch, "child-%d-rank%d.log" % (self.counter, rank)), "wb")
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-worker",
                                           json.dumps(spec)], stdout=log, stderr=subprocess.STDOUT, env=env))
            log.close()
            results.append(result)
        ended = True
        for proc in procs:
            try:
                proc.wait(timeout=CHILD_TIMEOUT)
            except subprocess.TimeoutExpired:
                ended = False  # a hang: what this fault is to rule out
                proc.kill()
                proc.wait()
        out = [self.result(r, p.returncode) for r, p in zip(results, procs)]
        self.report["rank_steps_trained"] += len(out[0].get("losses", {}))
        return out, procs[1].returncode, ended

    def dist_checkpoint_diffs(self, reference, resumed):
        """The tensors (LoRA factors, optimizer state) and manifest entries
        of the final distributed checkpoints that differ. Each save draws a
        checkpoint_id of its own: that field alone may differ."""
        from safetensors.torch import load_file
        final = "step-%d" % self.saves[-1]
        diffs = []
        for name in sorted(os.listdir(os.path.join(reference, final))):
            theirs, mine = os.path.join(reference, final, name), os.path.join(resumed, final, name)
            if not os.path.isfile(mine):
                diffs.append("%s/%s missing" % (final, name))
            elif name.endswith(".safetensors"):
                a, b = load_file(theirs), load_file(mine)
                diffs += ["%s/%s %s" % (final, name, k) for k in sorted(set(a) | set(b))
                          if _raw(a.get(k)) != _raw(b.get(k))]
            elif name.endswith(".json"):
                a, b = (json.load(open(f)) for f in (theirs, mine))
                a.pop("checkpoint_id", None), b.pop("checkpoint_id", None)
                if a != b:
                    diffs.append("%s/%s" % (final, name))
            elif open(theirs, "rb").read() != open(mine, "rb").read():
                diffs.append("%s/%s" % (final, name))
        return diffs

    def rank_killed(self, where):
        import kt
        if "gloo" not in kt.build_info():  # a wheel built without libgloo, say
            self.report["skipped"]["rank_killed"] = "this kt was built without Gloo (kt.build_info(): %s)" % (
                kt.build_info())
            return "rank_killed", None
        if self.dist_reference is None:
            os.makedirs(os.path.join(self.scratch, "dist-reference"))
            self.dist_reference, _, _ = self.ranks(os.path.join(self.scratch, "dist-reference"))
            if any("error" in r for r in self.dist_reference):
                raise RuntimeError("the 2-rank reference run failed: %s" %
                                   [r.get("error") for r in self.dist_reference])
        step = self.rng.randint(1, self.args.steps)
        what = "rank_killed rank 1 at step %d" % step
        (first, _), status, ended = self.ranks(where, kill_step=step)
        if status != -signal.SIGKILL:
            return what, self.fail(what, "rank 1 was not killed (status %s)" % status)
        if not ended or "error" not in first:
            return what, self.fail(what, "rank 0 did not fail: %s" % (first.get("error") or "it hung"))
        self.report["errors"].append({"fault": what, "error": first["error"][:300],
                                      "seconds_to_error": first.get("error_after_s")})
        if first.get("error_after_s") is not None and first["error_after_s"] > 3 * COMM_TIMEOUT:
            return what, self.fail(what, "rank 0 failed after %.1f s, past the communicator's timeout of %.0f s"
                                   % (first["error_after_s"], COMM_TIMEOUT))
        # kt publishes a distributed checkpoint atomically: every step-N
        # folder there is complete.
        saved = sorted(int(n.split("-")[1]) for n in os.listdir(os.path.join(where, "checkpoints"))
                       if n.startswith("step-")) if os.path.isdir(os.path.join(where, "checkpoints")) else []
        resume = os.path.join(where, "checkpoints", "step-%d" % saved[-1]) if saved else None
        got, _, ended = self.ranks(where, resume=resume)
        at = saved[-1] if saved else 0
        diffs = []
        for rank, (ref, run) in enumerate(zip(self.dist_reference, got)):
            if "error" in run:
                return what, self.fail(what, "rank %d of the resumed run failed: %s" % (rank, run["error"]))
            diffs += ["rank %d %s" % (rank, k) for k in ref["params"]
                      if _raw(ref["params"][k]) != _raw(run["params"][k])]
            diffs += ["rank %d loss of step %d" % (rank, s) for s in range(at + 1, self.args.steps + 1)
                      if _raw(ref["losses"][s]) != _raw(run["losses"].get(s))]
        diffs += self.dist_checkpoint_diffs(os.path.join(self.scratch, "dist-reference", "checkpoints"),
                                            os.path.join(where, "checkpoints"))
        if diffs:
            return what, self.fail(what, "differs from the 2-rank reference: " + ", ".join(diffs[:8]))
        self.report["resumes"] += 1
        return what, True

    def nan_grad(self, where):
        step = self.rng.randint(1, self.args.steps)
        fault = {"kind": "nan_grad", "step": step, "param": self.rng.randrange(1000),
                 "element": self.rng.randrange(1 << 20), "value": self.rng.choice(["nan", "inf", "-inf"])}
        got = self.child(os.path.join(where, "out"), fault=fault)
        nan = got.get("nan", {})
        what = "nan_grad %s at step %d in %s" % (fault["value"], step, nan.get("param"))
        if "error" in got:
            return what, self.fail(what, "the run failed: " + got["error"])
        if not nan.get("unchanged"):
            return what, self.fail(what, "the step with a non-finite gradient changed the parameters or state")
        import math
        if got["global_step"] != self.args.steps or not all(math.isfinite(float(v)) for v in got["losses"].values()):
            return what, self.fail(what, "the run did not go on to step %d with finite losses" % self.args.steps)
        return what + " (%d tensors unchanged by the step)" % nan["tensors_compared"], True

    def run(self):
        started = time.time()
        self.setup()
        order = []
        while True:
            if self.args.faults is not None and sum(self.report["injected"].values()) + len(
                    self.report["skipped"]) >= self.args.faults:
                break
            # Time is checked between rounds: every kind gets a turn in each.
            if not order and self.report["faults"] and time.time() - started >= self.args.minutes * 60:
                break
            if not order:
                order = self.args.kinds.split(",")
                self.rng.shuffle(order)
            kind = order.pop(0)
            if kind in self.report["skipped"]:
                continue
            where = tempfile.mkdtemp(prefix=kind + "-", dir=self.scratch)
            try:
                what, ok = getattr(self, kind)(where)
            finally:
                if not self.args.keep:
                    shutil.rmtree(where, ignore_errors=True)
            if ok is None:
                continue
            self.report["injected"][kind] += 1
            self.report["survived"][kind] += bool(ok)
            self.report["faults"].append({"kind": kind, "what": what, "survived": bool(ok)})
            print("%-15s %-8s %s" % (kind, "survived" if ok else "FAILED", what), flush=True)
        self.report["wall_s"] = round(time.time() - started, 1)
        self.report["steps"] = self.args.steps
        self.report["cpu"] = cpu()
        return self.report


def cpu():
    flags, name = set(), ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    return {"model": name, "isa_flags": sorted(f for f in flags if f.startswith(("avx512", "amx")))}


def table(report):
    lines = ["%-15s %9s %9s" % ("fault", "injected", "survived")]
    for k in KINDS:
        lines.append("%-15s %9d %9d%s" % (k, report["injected"][k], report["survived"][k],
                                          "   skipped: " + report["skipped"][k] if k in report["skipped"] else ""))
    lines.append("resumes %d, optimizer steps trained %d (Trainer) and %d (2-rank loop), wall %.0f s" % (
        report["resumes"], report["steps_trained"], report["rank_steps_trained"], report["wall_s"]))
    lines.append("cpu: %s (%s)" % (report["cpu"]["model"], " ".join(report["cpu"]["isa_flags"]) or "no AVX-512"))
    for f in report["failures"]:
        lines.append("FAILURE " + f)
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--faults", type=int, default=None, help="stop after this many faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help="the faults to draw from, comma-separated")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (the children's logs)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rank-worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run(args):
    if PLUGIN not in sys.path:
        sys.path.insert(0, PLUGIN)
    scratch = tempfile.mkdtemp(prefix="kt-train-soak-")
    try:
        return Soak(args, scratch).run()
    finally:
        if args.keep:
            print("scratch kept in", scratch)
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        sys.path.insert(0, PLUGIN)
        return _worker(json.loads(args.worker))
    if args.rank_worker:
        sys.path.insert(0, PLUGIN)
        return _rank_worker(json.loads(args.rank_worker))
    report = run(args)
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
