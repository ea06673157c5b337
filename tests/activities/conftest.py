"""The worker's activities (activities/): each against fakes or loopback servers
(tests/support/comfy_fakes.py, tests/activities/follower_rig.py, aiohttp apps), the storage tests
against the session's SeaweedFS (`local_stack`, tests/conftest.py). No shared fixture yet."""
