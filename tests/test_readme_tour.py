"""The README's five-minute tour, run as written (each command from the repository's folder, here a temporary one
with the examples beside it): every command succeeds (`packfeed index` with 3, samples left out, as the README
says) and leaves what the next one reads."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from doc_commands import REPO, commands_run_by


@pytest.mark.slow
def test_the_five_minute_tour_runs_as_written(tmp_path):
    commands = commands_run_by("tests/test_readme_tour.py")
    assert [shlex.split(c)[0] for c in commands][:2] == ["packfeed", "packfeed"] and len(commands) >= 6
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    bin_dir = str(Path(sys.executable).parent)  # `packfeed` and `python` as an activated .venv has them
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        expected = 3 if shlex.split(command)[1] == "index" else 0
        assert done.returncode == expected, f"{command}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    assert (tmp_path / "tour" / "plan.parquet").is_file() and (tmp_path / "tour" / "report" / "report.html").is_file()
    assert "samples in 2 packs" in done.stdout  # the last command: one step of the client
