"""Fixtures for the Encodon model tests."""

import pytest
from codonfm_testing import reference_model
from encodon_reference import EncodonReference


@pytest.fixture
def reference_tiny() -> EncodonReference:
    return reference_model()
