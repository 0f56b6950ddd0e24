"""What a run reports: step metrics and their backends, FLOPs and MFU, and the PNG report."""
