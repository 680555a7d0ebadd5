"""The live-server fixtures of tests/service, shared with the reliability tests."""

from tests.service.conftest import long_model_dir  # noqa: F401  (a fixture)
