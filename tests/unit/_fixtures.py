"""The real command outputs in tests/fixtures (copied from shared/fixtures, see INDEX.md)."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()
