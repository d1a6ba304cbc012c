"""One tiny random model per test process: its jitted pieces compile once for all modules."""
import functools

from models import tiny_model


@functools.lru_cache(maxsize=None)
def shared_tiny_model():
    """4-layer tiny Llama (H=6, H_kv=2, D=16, vocab 301), shared; do not mutate its params."""
    return tiny_model("llama", seed=0, num_layers=4)
