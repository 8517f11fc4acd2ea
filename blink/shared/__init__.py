"""Torch-free pieces that both the frontend (``blink.dpu``) and the engine side use.

Nothing here imports torch, triton or cupy (``tests/test_import_graph.py`` checks), so the
frontend on a DPU can import it, and the engine side can import it without importing the
frontend: the two sides meet here instead of importing each other.
"""
