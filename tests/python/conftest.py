import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The package under test is the source tree's, whatever else is installed.
sys.path.insert(0, os.path.join(ROOT, "plugins", "python"))
sys.path.insert(0, HERE)

import pytest  # noqa: E402

from helpers import measured  # noqa: E402


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


@pytest.fixture
def correctly_rounded_sqrt():
    """torch.Tensor.sqrt correctly rounded while the test runs.

    kt's optimizer steps are torch.optim's for-loop arithmetic, which is
    correctly rounded everywhere in torch 1.13. torch 2's CPU sqrt of a
    float32 tensor goes through MKL's vector math and is not (about one
    element in five is one ulp off on an AVX2 CPU), so AdamW's denominator,
    and with it the parameters, can differ in the last bit from a correctly
    rounded step. With this fixture torch's own AdamW runs with numpy's
    (correctly rounded) sqrt, and the parameters are then compared bit for
    bit; test_optim.py also compares against the unpatched torch."""
    import numpy as np
    import torch
    if int(torch.__version__.split(".")[0]) < 2:
        yield False
        return
    original = torch.Tensor.sqrt

    def sqrt(self):
        if self.dtype != torch.float32 or self.device.type != "cpu" or self.requires_grad:
            return original(self)
        return torch.from_numpy(np.sqrt(self.contiguous().numpy())).view(self.shape)

    torch.Tensor.sqrt = sqrt
    try:
        yield True
    finally:
        torch.Tensor.sqrt = original
