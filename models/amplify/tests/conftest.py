"""Fixtures for the AMPLIFY model tests."""

import pytest
from amplify_reference import AmplifyReference
from amplify_testing import reference_model


@pytest.fixture
def reference_tiny() -> AmplifyReference:
    return reference_model()
