"""Complete checkpoints of a transformers.Trainer run: which ``checkpoint-N``
folders a run can resume from.

Trainer writes ``output_dir/checkpoint-N`` in place, file by file (the
adapter or model, optimizer.pt, scheduler.pt, rng_state.pth,
trainer_state.json); a process killed or a disk filled mid-save leaves a
folder that looks like a checkpoint, and ``trainer.train(
resume_from_checkpoint=True)`` takes the newest folder whatever its state.
``CompleteCheckpoints`` (a TrainerCallback) writes ``kt_checkpoint.json``
into each checkpoint once Trainer has written all of it, atomically (a
temporary file renamed): the size and SHA-256 of every file. A folder is
complete when that record is there and every file it lists has its size and
digest; ``verify_checkpoint`` says why a folder is not (naming the file),
``last_complete_checkpoint`` finds the newest complete one.

Bounds: every file is read once at each save to take its digest (the
checkpoints of LoRA training are small; a full model's are not). Only the
main process (``state.is_world_process_zero``) writes the record, into
``args.output_dir`` (not the folders of a hyperparameter search). Needs
transformers for the callback only.
"""
import hashlib
import json
import os
import re

from .._safetensors import write_atomic

RECORD = "kt_checkpoint.json"
FORMAT = "kt-checkpoint-1"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class IncompleteCheckpointError(ValueError):
    """A checkpoint folder that a run must not resume from; the message names
    the file and the reason."""


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(directory):
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            # Temporary files of atomic writers start with a dot.
            if name == RECORD or name.startswith("."):
                continue
            out.append(os.path.relpath(os.path.join(root, name), directory))
    return sorted(out)


def write_record(directory, global_step):
    """Records ``directory`` as complete at ``global_step``: call it once
    every file of the checkpoint is written."""
    files = {rel: {"size": os.path.getsize(os.path.join(directory, rel)),
                   "sha256": _digest(os.path.join(directory, rel))} for rel in _files(directory)}
    record = {"format": FORMAT, "global_step": int(global_step), "files": files}
    write_atomic(os.path.join(directory, RECORD), [(json.dumps(record, indent=1) + "\n").encode()])
    return record


def verify_checkpoint(directory):
    """Returns the record of a complete checkpoint folder; raises
    IncompleteCheckpointError naming the file and the reason otherwise."""
    directory = os.fspath(directory)
    path = os.path.join(directory, RECORD)
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read())
    except FileNotFoundError:
        raise IncompleteCheckpointError("kt: %s does not exist: the save of %s did not finish" % (path, directory))
    except (OSError, ValueError) as e:
        raise IncompleteCheckpointError("kt: %s is unreadable: %s" % (path, e))
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("files"), dict):
        raise IncompleteCheckpointError("kt: %s is not a %s record" % (path, FORMAT))
    for rel, want in sorted(record["files"].items()):
        file = os.path.join(directory, rel)
        if not os.path.isfile(file):
            raise IncompleteCheckpointError("kt: %s is missing (recorded in %s)" % (file, RECORD))
        size = os.path.getsize(file)
        if size != want["size"]:
            raise IncompleteCheckpointError("kt: %s has %d bytes; %d were saved" % (file, size, want["size"]))
        if _digest(file) != want["sha256"]:
            raise IncompleteCheckpointError("kt: %s has other contents than were saved (SHA-256 differs)" % file)
    return record


def checkpoints(output_dir):
    """The ``checkpoint-N`` folders of output_dir, newest (largest N) first."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else ():
        m = _CHECKPOINT.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found, reverse=True)]


def last_complete_checkpoint(output_dir, refusals=None):
    """The newest complete checkpoint folder of output_dir, or None. The
    reason each newer folder was passed over is appended to ``refusals``
    (a list) when one is given."""
    for path in checkpoints(output_dir):
        try:
            verify_checkpoint(path)
            return path
        except IncompleteCheckpointError as e:
            if refusals is not None:
                refusals.append(str(e))
    return None


def _callback_class():
    from transformers import TrainerCallback

    class CompleteCheckpoints(TrainerCallback):
        """Writes kt_checkpoint.json into each checkpoint once Trainer has
        saved all of it."""

        @staticmethod
        def _directory(args, state):
            return os.path.join(args.output_dir, "checkpoint-%d" % state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            # A run resumed from an older checkpoint saves into folders of
            # the same names again: their old record goes before the files
            # change, so a save cut short is not taken for the old one.
            if control.should_save and state.is_world_process_zero:
                stale = os.path.join(self._directory(args, state), RECORD)
                if os.path.exists(stale):
                    os.unlink(stale)

        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                write_record(self._directory(args, state), state.global_step)

    return CompleteCheckpoints


def __getattr__(name):
    # The callback class needs transformers: made at first use.
    if name == "CompleteCheckpoints":
        cls = _callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
