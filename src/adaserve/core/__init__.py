"""Torch-free scheduling core shared by the engine and the simulator.

Nothing under ``adaserve.core`` imports torch (``tests/test_layout.py`` checks it): the
engine (``adaserve.engine``, torch) and the simulator (``adaserve.sim``, no torch) each
hold one ``Scheduler`` and differ only in how a pass is executed and timed.
"""
