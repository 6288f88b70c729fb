"""Unknown ``TANDEM_*`` variables are said, not ignored in silence (shared/settings.py
``unknown_env``), and the list of variables read outside Settings is whole."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.settings import ELSEWHERE, env_vars, unknown_env

ROOT = Path(__file__).resolve().parents[2]
NOT_VARIABLES = {"TANDEM_KVEVENTS"}   # a JetStream stream's name (shared/kv_events.py)


def test_a_typo_is_named_with_the_variable_it_was_meant_to_be():
    said = unknown_env({"TANDEM_THREDS": "4", "TANDEM_THREADS": "2", "TANDEM_GPU_AHEAD": "1",
                        "TANDEM_FROBNICATE": "1", "PATH": "/bin"})
    assert list(said) == ["TANDEM_FROBNICATE", "TANDEM_THREDS"]
    assert said["TANDEM_THREDS"].endswith("did you mean TANDEM_THREADS?")
    assert "did you mean" not in said["TANDEM_FROBNICATE"]


def test_every_variable_the_code_reads_is_known():
    """Every quoted ``"TANDEM_X"`` in the code and every ``${TANDEM_X`` in the scripts is a
    setting or in ELSEWHERE — else setting it would be reported as unknown."""
    names = set()
    for folder in ("shared", "services", "kernels", "bench", "kvpool"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"[\"'](TANDEM_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    for path in (ROOT / "scripts").iterdir():
        if path.is_file():
            names |= set(re.findall(r"\$\{(TANDEM_[A-Z0-9_]+)", path.read_text(errors="replace")))
    known = {v for v, _, _ in env_vars()} | set(ELSEWHERE)
    assert len(names) > 100
    assert names - known - NOT_VARIABLES == set()
    assert set(ELSEWHERE) <= names, "ELSEWHERE names a variable nothing reads"


def test_the_command_warns_once_and_up_does_not_pass_it_to_every_copy(tmp_path):
    """`tandem` says it on start; `tandem up` drops the variable from its copies' environment
    (it has no effect) so that six copies do not say it again."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TANDEM_KV_BUDGT_MB": "64"}
    out = subprocess.run([sys.executable, "-m", "services.cli", "nats-auth", "--config", "-"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("TANDEM_KV_BUDGT_MB is not a Tandem setting") == 1
    assert "did you mean TANDEM_KV_BUDGET_MB?" in out.stderr


@pytest.mark.parametrize("env, said", [
    # nan passed every "x <= 0" check (heartbeats then carried null: no worker was ever seen), inf overflowed
    ({"TANDEM_HEARTBEAT_INTERVAL": "nan"}, "TANDEM_HEARTBEAT_INTERVAL='nan': expected a finite number"),
    ({"TANDEM_RESUME_WAIT_S": "inf"}, "TANDEM_RESUME_WAIT_S='inf': expected a finite number"),
    ({"TANDEM_POOL_DISK_GB": "inf"}, "TANDEM_POOL_DISK_GB='inf': expected a finite number"),
    # values every worker died of (a traceback, a C++ abort), after the stack had started
    ({"TANDEM_DEVICE": "foo"}, "TANDEM_DEVICE must be cpu, cuda or cuda:N"),
    ({"TANDEM_THREADS": "99999999999999999999"}, "TANDEM_THREADS and TANDEM_LOAD_THREADS must be at most"),
    ({"TANDEM_KV_BUDGET_MB": "99999999999999999999"}, "TANDEM_KV_BUDGET_MB must be at most"),
    ({"TANDEM_KV_BUDGET_MB_CPU_DECODE": "99999999999999999999"}, "TANDEM_KV_BUDGET_MB_CPU_DECODE must be at most"),
    # JetStream refused the negative age: every stored Response was lost behind a 200
    ({"TANDEM_RESPONSES_RETENTION_S": "-1"}, "TANDEM_RESPONSES_RETENTION_S must be > 0"),
    ({"TANDEM_POOL_CHUNK_TOKENS": "100"}, "TANDEM_POOL_CHUNK_TOKENS must be a multiple of the KV block (16"),
])
def test_a_value_no_service_could_run_with_is_refused_naming_it(env, said):
    from shared.settings import Settings
    with pytest.raises(ValueError) as e:
        Settings.from_env(env)
    assert said in str(e.value)
    Settings.from_env({"TANDEM_DEVICE": "cuda:1", "TANDEM_THREADS": "64", "TANDEM_HEARTBEAT_INTERVAL": "0.5"})


def test_docs_settings_md_is_the_generated_list():
    """docs/settings.md lists every setting with its default (generated: `python -m shared.settings >
    docs/settings.md`); a setting added, renamed or re-documented without regenerating it fails here."""
    from pathlib import Path

    from shared.settings import env_vars, settings_markdown
    text = (Path(__file__).resolve().parents[2] / "docs" / "settings.md").read_text()
    assert text == settings_markdown(), "docs/settings.md is stale: run `python -m shared.settings > docs/settings.md`"
    assert all(f"`{var}`" in text for var, _, _ in env_vars())
