"""The main SmartGen demo (same as `jkv demo`): full vs smartgen transfer on SmolLM2 with one
decode and two prefill worker processes; see jkv/disagg/demo.py."""
import sys

from jkv.disagg.demo import main

if __name__ == "__main__":
    sys.exit(main())
