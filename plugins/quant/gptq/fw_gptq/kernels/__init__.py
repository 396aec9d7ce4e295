"""The W4A16 / W8A16 kernel layout (`layout`, torch only) and its Triton core (`wna16`)."""
