"""The RunPod side of the protocol core: the contract our handler and the orchestrator share."""
