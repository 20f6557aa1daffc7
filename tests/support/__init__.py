"""Helpers shared by the tests (not tests themselves): tiny agents and presets, process and
TensorBoard probes, reference implementations, and the scripts that tests run in subprocesses.

pytest puts ``tests/`` on ``sys.path`` (it has no ``__init__.py``), so tests import these as
``support.<module>``; the subprocess scripts put ``tests/`` there themselves, and tests that start
Ray workers or CLI subprocesses pass it in ``PYTHONPATH``.
"""
