"""Builders the tests share; no test module imports another (tests/test_tests.py)."""
