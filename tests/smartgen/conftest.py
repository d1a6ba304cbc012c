"""Session fixtures for the SmartGen tests (helpers live in smartgen_cases.py)."""
from tests.smartgen.smartgen_cases import model, profiles, prompts, selectors  # noqa: F401
