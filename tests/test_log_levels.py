"""Programs quieten PopTorch's logger by name; poptorchsim's messages follow."""
import logging

import pytest

import poptorchsim


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_quietening_poptorchs_logger_quietens_poptorchsim():
    theirs = logging.getLogger(poptorchsim.POPTORCH_LOGGER)
    records = _Records()
    poptorchsim.logger.addHandler(records)
    try:
        poptorchsim.logger.warning("shown: nobody set PopTorch's logger")
        theirs.setLevel(logging.ERROR)              # Graphcore's BERT does this
        poptorchsim.logger.warning("hidden")
        poptorchsim.logger.error("shown: an error")
        theirs.setLevel(logging.NOTSET)
        poptorchsim.logger.warning("shown again")
    finally:
        theirs.setLevel(logging.NOTSET)
        poptorchsim.logger.removeHandler(records)
    assert records.messages == ["shown: nobody set PopTorch's logger", "shown: an error",
                                "shown again"]


def test_popart_log_level_takes_poptorchs_names():
    for bad in (0, "FOO"):
        with pytest.raises(ValueError, match="Level must be one of"):
            poptorchsim._logging.setPopartLogLevel(bad)
    poptorchsim._logging.setPopartLogLevel("DEBUG")
    assert poptorchsim._logging.popart_log_level == "DEBUG"
    poptorchsim._logging.setPopartLogLevel("WARN")
