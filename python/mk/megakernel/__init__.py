"""The decode megakernel's host side in Python: step graphs, step buffers, and a CPU interpreter
that executes a graph task by task with PyTorch (the oracle the CUDA kernel is diffed against)."""
