"""The ComfyUI side of the protocol core: see `protocol/__init__.py` for what each module holds."""
