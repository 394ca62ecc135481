"""tests/helpers/proc_net: a process that exits between the group's listing and the read of its
command line is skipped, not an error (the e2e tests look for a stage's stub while other
processes of the server's group come and go)."""

from __future__ import annotations

import os
import subprocess
import sys

import proc_net


def test_a_gone_process_has_an_empty_command_line_and_is_no_stub():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its /proc entry is gone
    assert proc_net.cmdline(child.pid) == b""
    assert proc_net.cmdline(os.getpid())  # a live one has its arguments
    assert proc_net.stage_stub(child.pid, "decode") is None


def test_the_stub_of_a_stage_is_found_in_its_group(tmp_path):
    stub = tmp_path / "decode" / "1" / "model.py"
    stub.parent.mkdir(parents=True)
    stub.write_text("import time\ntime.sleep(30)\n")
    child = subprocess.Popen([sys.executable, str(stub)], start_new_session=True)
    try:
        assert proc_net.stage_stub(child.pid, "decode") == child.pid
        assert proc_net.stage_stub(child.pid, "prefill") is None
    finally:
        child.kill()
        child.wait()
