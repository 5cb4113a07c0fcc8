"""The README's promises: its commands are the ones CI and the Makefile run, its reference lists every setting."""

from pathlib import Path

from rlvr.config import describe_settings

ROOT = Path(__file__).resolve().parents[1]


def test_readme_reference_lists_every_setting_with_its_default():
    readme = (ROOT / "README.md").read_text()
    for _, name, default, _ in describe_settings():
        assert f"| `{name}` | `{default}` |" in readme, f"README's configuration reference lacks {name} = {default}"


def test_ci_runs_the_test_command_the_readme_gives():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
