import os
import sys

# The launched ranks import this folder's modules (the workers and cases.py) by name.
sys.path.insert(0, os.path.dirname(__file__))
