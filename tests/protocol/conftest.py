"""The protocol core's tests (protocol/): ComfyUI's frames, history records, socket and silence
rules, keys and progress, read with no Temporal and no stack: fakes and loopback sockets only.
No shared fixture yet; what a module needs it builds itself."""
