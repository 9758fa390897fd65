"""The README's first screen and .ci/run stay in step: CI runs exactly the test command users see."""

from tests.paths import REPO

ROOT = REPO


def _command_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command():
    readme = _command_lines((ROOT / "README.md").read_text())
    ci = _command_lines((ROOT / ".ci" / "run").read_text())
    assert len(readme) == 2, "the README's first screen holds two set-up commands"
    assert readme[0].endswith("zeroplan estimate llama-2-7b --gpus 8 --zero 3")
    assert "pytest" in readme[1] and "torch==2.13.0" in readme[1]
    assert ci == [readme[1]]


def test_setup_commands_are_on_the_first_screen():
    first_screen = (ROOT / "README.md").read_text().splitlines()[:24]
    assert len(_command_lines("\n".join(first_screen))) == 2
