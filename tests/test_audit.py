"""The exactly-once audit tool on logs written by the trainer's writer, across kills and resumes.

The logs are written with :class:`~torchtitan_wlb.audit_log.AuditLog` exactly as the trainer
does (no training here): a two-DP-rank run over a fixed plan, killed and resumed at chosen steps.
Multi-process runs audited by the tool are in tests/test_kill_resume.py and tests/test_e2e_4d.py.
"""

import json
import os

import pytest

from torchtitan_wlb.audit_log import AuditLog
from torchtitan_wlb.tools.audit import audit, main

# Steps 1-6 of a 2-DP-rank run, 2 micro-batches per rank: PLAN[step - 1][dp_rank] = micro-batches.
# Documents 0-19; document 9 waits in the packer from step 2 to step 5.
PLAN = [
    [[[0], [1]], [[2, 3], [4]]],
    [[[5], [6]], [[7], [8]]],
    [[[10], [11]], [[12], [13]]],
    [[[14], []], [[15], [16]]],
    [[[9], [17]], [[18], []]],
    [[[19], []], [[], []]],
]
PENDING = {1: [], 2: [9], 3: [9], 4: [9], 5: [], 6: []}  # after each step
DOCUMENTS = 20


class Run:
    """Writes the audit logs of one run: ``launch`` runs steps and checkpoints like the trainer."""

    def __init__(self, folder, ranks_per_dp=1, plan=PLAN, pending=PENDING):
        self.folder = str(folder)
        self.ranks_per_dp = ranks_per_dp
        self.plan = plan
        self.pending = pending
        self.launches = 0

    def launch(self, resumed_from, last_step, ckpt_every=2, end=None, killed_mid_write=False):
        self.launches += 1
        logs = [
            AuditLog(self.folder, rank, rank // self.ranks_per_dp, 2)
            for rank in range(2 * self.ranks_per_dp)
        ]
        for log in logs:
            log.start(f"L{self.launches}", float(self.launches), resumed_from)
        for step in range(resumed_from + 1, last_step + 1):
            for log in logs:
                log.begin_step()
                for mb in self.plan[step - 1][log.dp_rank]:
                    log.add_micro_batch(mb)
                log.step_done(step)
            if step % ckpt_every == 0:
                for log in logs:
                    log.checkpoint(step, self.pending[step])
        if end is not None:
            for log in logs:
                log.end(last_step, end, self.pending[last_step], DOCUMENTS)
        if killed_mid_write:
            with open(logs[0].path, "a") as f:
                f.write('{"event": "step", "launch": "L')
        return logs


def test_uninterrupted_run_is_exactly_once(tmp_path):
    Run(tmp_path).launch(0, 6, end="end of data")
    report = audit(str(tmp_path))
    assert report.ok and report.complete, report.message
    assert report.documents == DOCUMENTS and report.steps == 6
    assert report.message.startswith("exactly once: 20 documents (ids 0-19) over steps 1-6")


def test_kills_and_resumes_supersede_the_retrained_steps(tmp_path):
    run = Run(tmp_path, ranks_per_dp=2)  # two ranks per DP rank (CP or PP peers)
    run.launch(0, 5, killed_mid_write=True)  # checkpoints 2, 4; killed in step 6
    run.launch(4, 4)  # resumed from 4, killed during step 5 before finishing it
    run.launch(4, 6, end="end of data")  # resumed from 4 again, to the end
    report = audit(str(tmp_path))
    assert report.ok and report.complete, report.message
    assert report.superseded == [(5, 5)]
    assert "3 launches, re-trained after resume: step 5" in report.message


def test_killed_run_counts_up_to_its_last_checkpoint(tmp_path):
    Run(tmp_path).launch(0, 5)  # checkpoints at 2 and 4 (document 9 pending), killed in step 6
    report = audit(str(tmp_path))
    assert report.ok and not report.complete, report.message
    assert report.steps == 4
    assert "counted up to its checkpoint of step 4, steps 5-5 will be re-trained" in report.message
    assert "1 still waiting in the packer" in report.message


def test_names_a_repeated_document_and_its_steps(tmp_path):
    plan = [list(step) for step in PLAN]
    plan[3] = [[[14], [3]], [[15], [16]]]  # document 3 again at step 4, DP rank 0, micro-batch 1
    Run(tmp_path, plan=plan).launch(0, 6, end="end of data")
    report = audit(str(tmp_path))
    assert not report.ok
    assert report.message == (
        "NOT exactly once: document 3 was trained twice: step 1 (DP rank 1, micro-batch 0) and "
        "step 4 (DP rank 0, micro-batch 1); steps 1-6 audited"
    )


def test_resume_from_the_wrong_state_repeats_documents(tmp_path):
    """A resume whose data state is ahead of its model (or behind) is caught."""
    run = Run(tmp_path)
    run.launch(0, 4)
    # The second launch claims to resume from 2 but replays the plan from step 1.
    logs = [AuditLog(str(tmp_path), r, r, 2) for r in range(2)]
    for log in logs:
        log.start("L2", 2.0, 2)
        for step, plan_step in ((3, 1), (4, 2), (5, 3), (6, 4)):
            log.begin_step()
            for mb in PLAN[plan_step - 1][log.dp_rank]:
                log.add_micro_batch(mb)
            log.step_done(step)
        log.end(6, "end of data", [], DOCUMENTS)
    report = audit(str(tmp_path))
    assert not report.ok
    assert report.message.startswith("NOT exactly once: document 0 was trained twice: step 1")


def test_names_a_lost_document_and_the_steps_around_it(tmp_path):
    plan = [list(step) for step in PLAN]
    plan[4] = [[[], [17]], [[18], []]]  # document 9 never leaves the packer's queue
    Run(tmp_path, plan=plan).launch(0, 6, end="end of data")
    report = audit(str(tmp_path))
    assert report.message == (
        "NOT exactly once: document 9 was never trained (document 8 at step 2; document 10 at "
        "step 3) and is not waiting in the packer; steps 1-6 audited"
    )


def test_lost_mid_run_is_told_from_waiting(tmp_path):
    pending = {**PENDING, 2: [], 4: []}  # the checkpoints forget document 9
    Run(tmp_path, pending=pending).launch(0, 5)
    report = audit(str(tmp_path))
    assert not report.ok and "document 9 was never trained" in report.message


def test_peers_of_one_dp_rank_must_agree(tmp_path):
    logs = Run(tmp_path, ranks_per_dp=2).launch(0, 6, end="end of data")
    with open(logs[1].path) as f:  # rank 1 (DP rank 0, as rank 0) trained other documents
        records = [json.loads(line) for line in f]
    for rec in records:
        if rec["event"] == "step" and rec["step"] == 6:
            rec["micro_batches"] = [[19, 5], []]
    with open(logs[1].path, "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records)
    report = audit(str(tmp_path))
    assert report.message == "NOT exactly once: ranks [0, 1] disagree on the documents of step 6"


def test_missing_rank_log_is_reported(tmp_path):
    logs = Run(tmp_path).launch(0, 6, end="end of data")
    os.remove(logs[1].path)
    report = audit(str(tmp_path))
    assert report.message == "NOT exactly once: step 1 has no audit record from DP rank 1"


def test_steps_limit_leaves_waiting_documents(tmp_path):
    Run(tmp_path).launch(0, 3, end="steps")
    report = audit(str(tmp_path))
    assert report.ok and not report.complete, report.message
    assert "the pass is not over; stopped by training.steps at step 3" in report.message


@pytest.mark.parametrize(
    "setup, expected",
    [
        ("missing", "no such directory"),
        ("empty", "no wlb_audit/ folder"),
        ("no_logs", "no rank_<N>.jsonl audit log"),
        ("malformed", "rank_0.jsonl:1: not a JSON line"),
        ("not_a_record", "rank_0.jsonl:1: not an audit record"),
        ("no_field", "rank_0.jsonl:1: step record without micro_batches"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, expected):
    folder = tmp_path / "run"
    if setup != "missing":
        folder.mkdir()
    if setup not in ("missing", "empty"):
        (folder / "wlb_audit").mkdir()
    line = {
        "malformed": "{not json\n",
        "not_a_record": '{"event": "dance"}\n',
        "no_field": '{"event": "step", "launch": "a", "rank": 0, "dp_rank": 0, "step": 1}\n',
    }.get(setup)
    if line:
        (folder / "wlb_audit" / "rank_0.jsonl").write_text(line + "{}\n")
    assert main([str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and expected in err, err


def test_cli_exit_status(tmp_path, capsys):
    Run(tmp_path / "done").launch(0, 6, end="end of data")
    Run(tmp_path / "partial").launch(0, 5)
    assert main([str(tmp_path / "done"), "--require-complete"]) == 0
    assert main([str(tmp_path / "partial")]) == 0
    assert main([str(tmp_path / "partial"), "--require-complete"]) == 1
    plan = [list(step) for step in PLAN]
    plan[5] = [[[19], [0]], [[], []]]
    Run(tmp_path / "bad", plan=plan).launch(0, 6, end="end of data")
    assert main([str(tmp_path / "bad")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[-1].startswith("NOT exactly once: document 0")
