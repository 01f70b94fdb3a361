import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The package under test is the source tree's, whatever else is installed.
sys.path.insert(0, os.path.join(ROOT, "plugins", "python"))
sys.path.insert(0, HERE)

import pytest  # noqa: E402

import measured  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    if measured.ERRORS:
        terminalreporter.write_sep("-", "kt vs torch autograd: max relative L2 error per quantity")
        for line in measured.summary_lines():
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def fp32_engine():
    """An engine whose weight GEMMs keep fp32 operands, for the tight comparisons."""
    import kt
    engine = kt.Engine(precision="fp32")
    assert engine.info()["precision"] == "fp32"
    assert engine.info()["isa"] in ("avx2", "ref")
    return engine
