"""LoRA training through transformers.Trainer with kt's experts under
injected faults (bench/train_soak.py at test size): one fault of each kind,
each resume bit-identical to the run that went through, the refusals naming
the file, and a 2-rank kt.dist run whose surviving rank fails within the
communicator's timeout when the other is killed. The enospc fault is reported skipped (the test then skips
it visibly) where this process may not mount a tmpfs, and rank_killed where
kt was built without Gloo (the pip wheel)."""
import os
import sys

import pytest

pytest.importorskip("transformers", reason="the real-host tests need transformers (tools/python_env.sh hosts)")
pytest.importorskip("peft", reason="the real-host tests need peft (tools/python_env.sh hosts)")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench"))

import train_soak  # noqa: E402


@pytest.fixture(scope="module")
def report():
    # --minutes 0: one round, every kind once, in a seeded order.
    out = train_soak.run(train_soak.parse_args(["--minutes", "0", "--seed", "3", "--steps", "6"]))
    print(train_soak.table(out))
    return out


def _faults(report, kind):
    return [f for f in report["faults"] if f["kind"] == kind]


def test_every_fault_survived(report):
    assert report["failures"] == []
    for kind in train_soak.KINDS:
        if kind in report["skipped"]:
            continue
        assert report["injected"][kind] == report["survived"][kind] == 1, (kind, report["faults"])
    # The resumes compared: kill_in_save, enospc, corrupt and rank_killed
    # each resumed once.
    assert report["resumes"] == 4 - ("enospc" in report["skipped"]) - ("rank_killed" in report["skipped"])


def test_partial_and_damaged_checkpoints_refused_by_name(report):
    refusals = report["refusals"]
    (kill,) = _faults(report, "kill_in_save")
    step = kill["what"].split()[1]  # "kill_in_save checkpoint-N file"
    assert any(step + "/kt_checkpoint.json does not exist: the save of " in r and "did not finish" in r
               for r in refusals), refusals
    (corrupt,) = _faults(report, "corrupt")
    name, step = corrupt["what"].split()[1], corrupt["what"].split()[3]
    reasons = ("has other contents than were saved", "bytes;")
    assert any("%s/%s" % (step, name) in r and any(w in r for w in reasons) for r in refusals), refusals
    # kt's packed cache: its own checksums and sizes.
    packed = [r for r in refusals if "layer0.ktpack: " in r]
    assert len(packed) == 1 and ("checksum mismatch" in packed[0] or "truncated" in packed[0]), packed


def test_nan_gradient_step_skipped_and_the_run_went_on(report):
    (nan,) = _faults(report, "nan_grad")
    # Every trainable tensor (q, v and the experts' down, A and B, 2 layers)
    # and its AdamW state (step, exp_avg, exp_avg_sq) compared as bytes.
    assert nan["survived"] and nan["what"].endswith("(48 tensors unchanged by the step)"), nan


def test_full_disk_stops_the_run(report):
    if "enospc" in report["skipped"]:
        pytest.skip("enospc not injected: " + report["skipped"]["enospc"])
    (enospc,) = [e for e in report["errors"] if e["fault"].startswith("enospc")]
    assert enospc["error"]
    assert any("enospc" == f["kind"] and f["survived"] for f in report["faults"])


def test_killed_rank_fails_the_other_within_the_timeout(report):
    if "rank_killed" in report["skipped"]:
        pytest.skip("rank_killed not injected: " + report["skipped"]["rank_killed"])
    (killed,) = [e for e in report["errors"] if e["fault"].startswith("rank_killed")]
    # kt's collective gives up on the peer: an error, not a hang, in time.
    assert killed["error"].startswith("CommError: KT_ERR_COMM: ") and "rank 0" in killed["error"], killed
    assert killed["seconds_to_error"] is not None
    assert killed["seconds_to_error"] <= 3 * train_soak.COMM_TIMEOUT, killed


def test_report_says_the_cpu(report):
    assert report["cpu"]["model"] and isinstance(report["cpu"]["isa_flags"], list)
    assert report["steps_trained"] >= 6 and report["wall_s"] > 0
