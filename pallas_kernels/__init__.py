"""Pallas GPU kernels for the SmartGen decode path, each with a pure-jnp reference.

Import the ops from `pallas_kernels.dispatch`: it runs the compiled Pallas kernels on a GPU and the
XLA references elsewhere. (They are not re-exported here: the function `split_reorder` would shadow
the module `pallas_kernels.split_reorder`.) See docs/kernels.md.
"""
