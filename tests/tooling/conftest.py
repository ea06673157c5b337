"""The tooling: the dev stack, the ComfyUI and RunPod simulators (and the conformance of the
former to a real ComfyUI), the soak audit and the bench groups. Simulators are only as good as
their last comparison with the real thing: test_comfy_sim_conformance.py is that comparison."""
