"""The serving tests' live server on the tiny chat model, shared with the bench tool's tests."""
from tests.serve.conftest import server

__all__ = ["server"]
