"""Puts tests/lab on sys.path so that the unit tests import lablib."""

import os
import sys

LAB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "lab")
if LAB_DIR not in sys.path:
    sys.path.insert(0, LAB_DIR)
