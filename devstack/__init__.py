"""The local stack: the Temporal dev server, SeaweedFS and the ComfyUI simulator on loopback."""
