"""The synchronizer role (`role`): one weight sync at a time."""
