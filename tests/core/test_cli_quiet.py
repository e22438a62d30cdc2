"""Third-party progress bars and warnings stay out of the CLI unless ``--verbose``."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHATTY = """
import sys, warnings
if sys.argv[1] == "quiet":
    from omnicore.cli.quiet import silence_third_party
    silence_third_party()
warnings.warn("a third-party deprecation", FutureWarning)
from tqdm.auto import tqdm
for _ in tqdm(range(3), desc="Loading pipeline components"):
    pass
from diffusers.utils import logging
logging.get_logger("diffusers.pipelines").warning("accelerate was not found")
print("done")
"""


@pytest.mark.slow
def test_silencing_removes_bars_and_warnings_of_the_libraries() -> None:
    def run(mode: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", CHATTY, mode], capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in __import__("os").environ.items()
                                   if not k.startswith(("TQDM_", "DIFFUSERS_", "TRANSFORMERS_", "HF_HUB_"))})

    loud, quiet = run("loud"), run("quiet")
    assert loud.returncode == quiet.returncode == 0, loud.stderr + quiet.stderr
    for text in ("a third-party deprecation", "Loading pipeline components", "accelerate was not found"):
        assert text in loud.stderr  # the libraries do print these by default ...
        assert text not in quiet.stderr  # ... and not once silenced
    assert quiet.stdout.strip() == "done"


def test_the_user_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from omnicore.cli.quiet import silence_third_party

    monkeypatch.setenv("DIFFUSERS_VERBOSITY", "info")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    with warnings.catch_warnings():
        applied = silence_third_party()
    assert "DIFFUSERS_VERBOSITY" not in applied and applied["TQDM_DISABLE"] == "1"
    import os

    assert os.environ["DIFFUSERS_VERBOSITY"] == "info"
    monkeypatch.delenv("TQDM_DISABLE")  # leave the session's environment as it was


@pytest.mark.parametrize("argv, silenced", [(["plugins", "--json"], True), (["--verbose", "plugins", "--json"], False),
                                            (["-v", "plugins", "--json"], False)])
def test_cli_silences_unless_verbose(argv: list[str], silenced: bool, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from omnicore.cli import main as cli
    from omnicore.cli import quiet

    calls: list[int] = []
    monkeypatch.setattr(quiet, "silence_third_party", lambda: calls.append(1) or {})
    monkeypatch.setenv("OMNICORE_PLUGINS", "")
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert bool(calls) is silenced
