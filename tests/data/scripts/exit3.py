"""Prints a line and exits with code 3: `python -m trainprof.wrap` must pass both through."""
import sys

print("exit3 says hello", sys.argv[1:])
sys.exit(3)
