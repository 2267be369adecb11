"""Test doubles: a model runner that runs no model (``FakeModelRunner``), for the scheduler's and
the engine's tests and the scheduler demo."""
